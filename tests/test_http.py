"""The HTTP edge both servers share (agentrl._http): bearer token and body limit, on a small app through ASGI."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from fastapi import Depends, FastAPI, Request

from agentrl._http import BodyLimit, bearer_auth


def app(token: str | None, max_bytes: int = 100) -> FastAPI:
    a = FastAPI()
    a.add_middleware(BodyLimit, max_bytes=max_bytes, hint="; send less")  # type: ignore[arg-type]

    @a.post("/echo", dependencies=[Depends(bearer_auth(token, hint=" (see the docs)"))])
    async def echo(request: Request) -> dict[str, int]:
        return {"received": len(await request.body())}

    return a


def client(a: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://test")


async def test_the_token_is_required_and_compared_exactly() -> None:
    async with client(app("s3cret")) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}):
            r = await c.post("/echo", content=b"x", headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", headers
            assert r.json()["detail"] == "missing or wrong bearer token (see the docs)"
        for scheme in ("Bearer", "bearer"):  # the scheme is case-insensitive (RFC 7235)
            r = await c.post("/echo", content=b"x", headers={"Authorization": f"{scheme} s3cret"})
            assert r.status_code == 200
    async with client(app(None)) as c:
        assert (await c.post("/echo", content=b"x")).status_code == 200  # no token set: open


async def test_bodies_over_the_limit_are_413_declared_or_streamed() -> None:
    async def chunks(n: int) -> AsyncIterator[bytes]:
        for _ in range(n):
            yield b"y" * 30

    async with client(app(None)) as c:
        r = await c.post("/echo", content=b"x" * 101)
        assert r.status_code == 413 and r.json()["detail"] == "request body over 100 bytes; send less"
        assert (await c.post("/echo", content=chunks(4))).status_code == 413  # no Content-Length
        r = await c.post("/echo", content=chunks(3))
        assert r.status_code == 200 and r.json() == {"received": 90}  # what passes reaches the app whole
