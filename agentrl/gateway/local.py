"""The gateway served inside the calling process: uvicorn on 127.0.0.1 (a free port) in the caller's event loop,
started once and shared by every session (a training run's agent episodes open one session each).

    async with LocalGateway(engine, tokenizer, GatewayConfig(...)) as gw:
        session = gw.store.create(limits=...)
        gw.base_url(session)            # http://127.0.0.1:PORT/sessions/<id>/v1, for an OpenAI client
        gw.http_client                  # an httpx client that reaches the same routes without a socket

Agents in this process (the ``agent`` environment kind) may send their requests through ``http_client``
(``openai.AsyncOpenAI(..., http_client=client.http_client)``): httpx's ASGI transport calls the app directly, which
skips the loopback socket, uvicorn and httpx's connection pool — about 1 ms of CPU per request here, half of what
a turn costs through loopback HTTP. The routes, answers and errors are the same; cancelling a request (its caller's
task) cancels its generation as a disconnect does. Agents in other processes use ``base_url`` over HTTP.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import httpx

from agentrl.engine.base import InferenceEngine
from agentrl.errors import InfrastructureError
from agentrl.gateway.base import GatewayConfig
from agentrl.gateway.core import Gateway
from agentrl.gateway.session import Session, SessionStore
from agentrl.tokenizer import ChatTokenizer

logger = logging.getLogger(__name__)


class LocalGateway:
    """A :class:`Gateway` and its :class:`SessionStore` behind an HTTP server on the loopback interface."""

    def __init__(self, engine: InferenceEngine, tokenizer: ChatTokenizer, config: GatewayConfig | None = None, *,
                 host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 30.0) -> None:
        self.gateway = Gateway(engine, tokenizer, config)
        self.store = SessionStore()
        self.host, self.port, self.start_timeout_s = host, port, start_timeout_s
        self.url = ""
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None
        self.http_client: Any = None  # an httpx.AsyncClient that agents may close without closing it
        self.anthropic_http_client: Any = None  # the same for the anthropic SDK, which takes its own httpx fork

    async def start(self) -> str:
        """Serve; returns the base URL (``http://127.0.0.1:PORT``)."""
        import uvicorn

        from agentrl.gateway.app import create_app

        app = create_app(self.gateway, self.store)
        # an app error is a 500 answer, as over HTTP, not an exception inside the agent's SDK; no timeout: there is
        # no network, and the gateway bounds every engine call itself
        self.http_client = _shared(httpx)(transport=httpx.ASGITransport(app, raise_app_exceptions=False),
                                          timeout=None)
        try:
            import httpx2  # installed with the anthropic SDK (whose clients must be httpx2's)
        except ImportError:
            pass
        else:
            self.anthropic_http_client = _shared(httpx2)(
                transport=httpx2.ASGITransport(app, raise_app_exceptions=False), timeout=None)
        self._server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port, log_level="warning",
                                                     lifespan="off", timeout_keep_alive=30))
        self._server.install_signal_handlers = lambda: None  # the process's own handlers stay in charge
        self._task = asyncio.create_task(self._server.serve())
        try:
            async with asyncio.timeout(self.start_timeout_s):
                while not self._server.started:
                    if self._task.done():
                        self._task.result()  # raises what stopped it
                        break
                    await asyncio.sleep(0.02)
        except (TimeoutError, OSError, SystemExit) as exc:
            await self.aclose()
            raise InfrastructureError(f"the agent gateway did not start on {self.host}:{self.port} within "
                                      f"{self.start_timeout_s:.0f}s: {exc!r}") from None
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        logger.info("agent gateway on %s", self.url)
        return self.url

    def base_url(self, session: Session) -> str:
        """The OpenAI base URL of ``session`` (its Anthropic base URL is this without the ``/v1``)."""
        return f"{self.url}/sessions/{session.id}/v1"

    async def aclose(self) -> None:
        for client in (self.http_client, self.anthropic_http_client):
            if client is not None:
                await client.close_for_good()
        self.http_client = self.anthropic_http_client = None
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            async with asyncio.timeout(10):
                await self._task
        except (TimeoutError, SystemExit):
            self._task.cancel()
        self._task = None

    async def __aenter__(self) -> LocalGateway:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


@functools.cache
def _shared(module: Any) -> Any:
    """An ``AsyncClient`` class of ``module`` (httpx or its fork httpx2) that agents may close without closing it:
    an SDK client closes the http client it was given (``async with openai.AsyncOpenAI(...)``), and every episode's
    agent gets the same one. The gateway closes it for good."""

    class SharedAsyncClient(module.AsyncClient):  # type: ignore[misc, name-defined]
        async def aclose(self) -> None:
            pass

        async def close_for_good(self) -> None:
            await super().aclose()

    return SharedAsyncClient
