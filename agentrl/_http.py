"""The edge of agentrl's HTTP servers (the sandbox server, the eval REST service, the agent gateway, the MCP server),
written once: the bearer-token check and the request-body limit.

A floor module: it imports only FastAPI/Starlette, so the sandbox (low in the dependency order) and the API (high)
both use it without an arrow pointing up or sideways.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import Depends
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def bearer_auth(token: str | None, *, hint: str = "", description: str | None = None) -> Callable[..., None]:
    """A FastAPI dependency: 401 (``WWW-Authenticate: Bearer``) unless the request carries
    ``Authorization: Bearer <token>``, compared in constant time. ``token`` None: every request passes.
    ``hint`` ends the 401 message (e.g. where the token comes from); ``description`` goes to the OpenAPI scheme."""
    scheme = HTTPBearer(auto_error=False, description=description)

    # a default, not Annotated: postponed annotations are resolved from module globals, and ``scheme`` is local
    def check(creds: HTTPAuthorizationCredentials | None = Depends(scheme)) -> None:  # noqa: B008
        if token is None:
            return
        given = creds.credentials if creds is not None else ""
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPException(401, f"missing or wrong bearer token{hint}", headers={"WWW-Authenticate": "Bearer"})

    return check


class BodyLimit:
    """ASGI middleware: 413 for a request body over ``max_bytes``, whether declared (``Content-Length``) or
    streamed (chunked); ``hint`` ends the message (what to do instead). The body is read before the app runs,
    so the app never sees more than ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int, hint: str = "") -> None:
        self.app, self.max_bytes, self.hint = app, max_bytes, hint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self._too_large(scope, receive, send)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = JSONResponse({"detail": f"request body over {self.max_bytes} bytes{self.hint}"}, status_code=413)
        await response(scope, receive, send)


class BearerGate:
    """ASGI middleware, for apps that are not FastAPI (the MCP server's Starlette app): the same check as
    :func:`bearer_auth` on every HTTP request (401 with ``WWW-Authenticate: Bearer`` unless it carries
    ``Authorization: Bearer <token>``, compared in constant time); lifespan events pass."""

    def __init__(self, app: ASGIApp, token: str, hint: str = "") -> None:
        self.app, self.token, self.hint = app, token.encode(), hint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"authorization", b"")
            given = header[7:] if header[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(given, self.token):
                response = JSONResponse({"detail": f"missing or wrong bearer token{self.hint}"}, status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)
