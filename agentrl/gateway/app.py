"""The gateway's HTTP server (FastAPI): chat routes per session, the same routes bare (the session from the API
key), and the control routes.

    POST /sessions                                 → {id, base_url, anthropic_base_url, api_key}
    POST /sessions/{sid}/v1/chat/completions       OpenAI (stream or not)
    POST /sessions/{sid}/v1/messages               Anthropic (stream or not)
    GET  /sessions/{sid}/v1/models
    POST /v1/chat/completions, /v1/messages; GET /v1/models   session from ``Authorization: Bearer`` / ``x-api-key``
    POST /sessions/{sid}/reward                    {reward, finished?, metrics?}
    POST /sessions/{sid}/finalize                  → the session's branches (and it is closed)
    POST /sessions/{sid}/abort                     cancel its generations, close it
    GET  /healthz

Errors: 400 unreadable messages, 401 unknown API key, 404 unknown session, 409 closed session, 503 engine failure
(the SDKs retry it; a retry of an answered body is replayed, never sampled again). A client that disconnects
cancels its generation (aborted on the engine). Control routes take the gateway's bearer token when one is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from agentrl._http import BodyLimit, bearer_auth
from agentrl.errors import EngineError
from agentrl.gateway import anthropic_api, openai_api
from agentrl.gateway.base import ChatCall, Completion, SessionClosed, SessionNotFound
from agentrl.gateway.core import Gateway
from agentrl.gateway.messages import MessageError
from agentrl.gateway.session import Session, SessionStore

RETRY_HEADER = "x-stainless-retry-count"


class CreateSession(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metadata: dict[str, Any] = {}


class RewardPost(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: float
    finished: bool = False
    metrics: dict[str, float] = {}


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def create_app(gateway: Gateway, store: SessionStore, *, public_url: str | None = None, token: str | None = None,
               max_body_bytes: int = 32 << 20) -> FastAPI:
    """The gateway's app. ``public_url`` is the base of the URLs ``POST /sessions`` hands out (default: the
    address the request came to)."""
    app = FastAPI(title="agentrl agent gateway", version="1")
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    control = [Depends(bearer_auth(token, hint="; the gateway's control routes need its token"))]
    model = gateway.config.model_name

    for exc_type, status in ((MessageError, 400), (SessionNotFound, 404), (SessionClosed, 409), (EngineError, 503)):
        app.add_exception_handler(exc_type, _handler(status))

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True, "sessions": len(store), "model": model}

    @app.post("/sessions", dependencies=control)
    async def create_session(request: Request, body: CreateSession | None = None) -> dict[str, str]:
        session = store.create((body or CreateSession()).metadata)
        base = (public_url or str(request.base_url)).rstrip("/") + f"/sessions/{session.id}"
        return {"id": session.id, "base_url": base + "/v1", "anthropic_base_url": base, "api_key": session.api_key}

    @app.post("/sessions/{sid}/reward", dependencies=control)
    async def post_reward(sid: str, body: RewardPost) -> dict[str, Any]:
        session = store.get(sid)
        session.check_open()
        session.reward, session.finished = body.reward, session.finished or body.finished
        session.metrics.update(body.metrics)
        return {"id": sid, "reward": session.reward, "finished": session.finished}

    @app.post("/sessions/{sid}/finalize", dependencies=control)
    async def finalize(sid: str) -> dict[str, Any]:
        return (await store.close(sid)).to_json()

    @app.post("/sessions/{sid}/abort", dependencies=control)
    async def abort(sid: str) -> dict[str, Any]:
        session = await store.close(sid)
        return {"id": sid, "aborted": True, "branches": len(session.branches)}

    async def chat(request: Request, session: Session, call: ChatCall,
                   render: Callable[[Completion], Response]) -> Response:
        key = hashlib.sha256(request.url.path.rsplit("/v1/", 1)[-1].encode() + await request.body()).hexdigest()
        retry = int(request.headers.get(RETRY_HEADER, "0") or 0)
        try:
            done = await _until_disconnect(request, gateway.complete(session, call, key=key, retry=retry))
        except ClientGone:
            session.check_open()  # aborted or finalized meanwhile: 409
            return Response(status_code=499)
        return render(done)

    def openai_render(body: openai_api.ChatCompletionRequest) -> Callable[[Completion], Response]:
        usage = bool((body.stream_options or {}).get("include_usage"))
        if body.stream:
            return lambda c: _sse(openai_api.completion_sse(c, body.model or model, include_usage=usage))
        return lambda c: JSONResponse(openai_api.completion_json(c, body.model or model))

    def anthropic_render(body: anthropic_api.MessagesRequest) -> Callable[[Completion], Response]:
        if body.stream:
            return lambda c: _sse(anthropic_api.message_sse(c, body.model or model))
        return lambda c: JSONResponse(anthropic_api.message_json(c, body.model or model))

    @app.post("/sessions/{sid}/v1/chat/completions")
    async def chat_completions(sid: str, request: Request, body: openai_api.ChatCompletionRequest) -> Response:
        return await chat(request, store.get(sid), body.to_call(), openai_render(body))

    @app.post("/sessions/{sid}/v1/messages")
    async def messages(sid: str, request: Request, body: anthropic_api.MessagesRequest) -> Response:
        return await chat(request, store.get(sid), body.to_call(), anthropic_render(body))

    @app.get("/sessions/{sid}/v1/models")
    async def session_models(sid: str) -> dict[str, Any]:
        store.get(sid)
        return openai_api.models_json(model)

    @app.post("/v1/chat/completions")
    async def bare_chat_completions(request: Request, body: openai_api.ChatCompletionRequest) -> Response:
        return await chat(request, _by_key(store, request), body.to_call(), openai_render(body))

    @app.post("/v1/messages")
    async def bare_messages(request: Request, body: anthropic_api.MessagesRequest) -> Response:
        return await chat(request, _by_key(store, request), body.to_call(), anthropic_render(body))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return openai_api.models_json(model)

    return app


def _by_key(store: SessionStore, request: Request) -> Session:
    auth = request.headers.get("authorization", "")
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
    try:
        return store.by_key(key)
    except SessionNotFound as exc:
        raise _Unauthorized(str(exc)) from None


class _Unauthorized(SessionNotFound):
    status = 401


def _handler(status: int) -> Callable[[Request, Exception], Awaitable[Response]]:
    async def handle(request: Request, exc: Exception) -> Response:
        code = getattr(exc, "status", status)
        # both SDKs read a message from either shape; this one is OpenAI's and close to Anthropic's
        return JSONResponse({"error": {"message": str(exc), "type": type(exc).__name__, "code": code}},
                            status_code=code)

    return handle


def _sse(events: Iterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _until_disconnect(request: Request, work: Awaitable[Completion]) -> Completion:
    """``work``'s result; cancelled (its generation aborted) if the client goes away first. A watcher task cancels
    the work on a disconnect (cheaper per request than ``asyncio.wait`` over both, which builds sets and callbacks
    each time)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_cancel_on_disconnect(request, task))
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled() and task.cancelled():
            raise ClientGone() from None
        raise  # this request's own task was cancelled (a server shutting down, an in-process caller gone)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _cancel_on_disconnect(request: Request, task: asyncio.Future[Completion]) -> None:
    await _disconnected(request)
    task.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
