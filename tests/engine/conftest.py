"""Fixtures of the engine tests: a misbehaving HTTP server (stalls, 503s, drops connections) on a free port."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web


class Misbehaving:
    """An HTTP server whose every route does what ``mode`` says: ``stall`` (never answers), ``503`` (always
    busy), ``slow_body`` (headers, then a body that never ends), ``drop`` (closes the connection)."""

    def __init__(self) -> None:
        self.mode = "stall"
        self.hits: list[str] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits.append(request.path)
        if self.mode == "503":
            return web.Response(status=503, text="busy")
        if self.mode == "drop":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(3600)
        if self.mode == "slow_body":
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            await resp.write(b'{"text": ')
            await asyncio.sleep(3600)
            return resp
        await asyncio.sleep(3600)
        return web.Response(text="{}")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def misbehaving() -> AsyncIterator[Misbehaving]:
    server = Misbehaving()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
