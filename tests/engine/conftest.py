"""Fixtures of the engine tests: a misbehaving HTTP server (stalls, 503s, drops connections) on a free port; a
squatter that takes a starting server's port."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aiohttp import web
from port_support import Squatter


class Misbehaving:
    """An HTTP server whose every route does what ``mode`` says: ``stall`` (never answers), ``503`` (always
    busy), ``slow_body`` (headers, then a body that never ends), ``drop`` (closes the connection), ``drop_reused``
    (answers the first request of a connection, closes it at the next one: a keep-alive connection the server
    timed out just as the client reused it), ``drop_first`` (reads the first request, then closes its connection;
    answers every later one with ``answer``: a server that got a request but whose answer never arrived)."""

    def __init__(self) -> None:
        self.mode = "stall"
        self.answer: Any = {}
        self.hits: list[str] = []
        self.bodies: list[Any] = []  # the JSON body of each hit (None if it had none)
        self.connections: dict[int, list] = {}  # id(transport) -> [transport (kept: ids stay unique), requests]
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        # the hit is recorded before the body is read: a client that gives up meanwhile (a 0.3 s deadline on a busy
        # machine) closes the connection, and the read then raises before anything would be recorded
        self.hits.append(request.path)
        self.bodies.append(None)
        at = len(self.bodies) - 1
        raw = await request.read()
        self.bodies[at] = json.loads(raw) if raw else None
        if self.mode == "503":
            return web.Response(status=503, text="busy")
        assert request.transport is not None
        entry = self.connections.setdefault(id(request.transport), [request.transport, 0])
        entry[1] += 1
        seen = entry[1]
        if self.mode == "drop_reused":
            if seen == 1:
                return web.json_response({"weight_version": "3", "success": True})
            request.transport.close()
            await asyncio.sleep(3600)
        if self.mode == "drop_first" and len(self.hits) > 1:
            return web.json_response(self.answer)
        if self.mode in ("drop", "drop_first"):
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

    async def arrival(self, path: str, timeout_s: float = 5.0) -> None:
        """Return once a request for ``path`` has arrived (a TimeoutError after ``timeout_s``)."""
        async with asyncio.timeout(timeout_s):
            while path not in self.hits:
                await asyncio.sleep(0.01)

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


@pytest.fixture
def squatter() -> Iterator[Squatter]:
    s = Squatter()
    yield s
    s.close()
