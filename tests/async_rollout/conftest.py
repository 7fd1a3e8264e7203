"""Fixtures of the rollout tests: a real (embedded) Redis server for the queue and weight registry."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from agentrl.queue import EmbeddedRedis


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
async def redis_client(redis_server: EmbeddedRedis) -> AsyncIterator[object]:
    from agentrl.queue import make_client

    client = make_client(redis_server.url)
    try:
        yield client
    finally:
        await client.aclose()
