"""Shared fixtures: ONE SGLang server (tiny model) and ONE embedded Redis per test session.

Tests that need them are marked ``sglang`` / ``redis``; both start lazily, on first use, and are stopped at the
end of the session. A test that uses (directly or through another fixture) a fixture named in ``NEEDS`` gets that
fixture's marker at collection, so ``-m "not sglang"`` / ``-m "not redis"`` skip every test that would start the
server; tests that start one themselves (a whole run, a ``serve`` process) carry the marker explicitly.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# fixture name -> the marker of the server it starts (the fixtures are defined here and in the packages' conftests)
NEEDS = {
    "sglang_url": "sglang", "sglang_server": "sglang",
    "redis_url": "redis", "redis_server": "redis", "redis_client": "redis",
    "embedded_server": "redis", "system_redis_url": "redis",
}


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m filter runs
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):  # the closure: fixtures of fixtures too
            marker = NEEDS.get(fixture)
            if marker is not None and item.get_closest_marker(marker) is None:
                item.add_marker(marker)


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from agentrl.models import resolve_model

    return resolve_model("tiny")


@pytest.fixture(scope="session")
def chat_tokenizer(tiny_model_path: Path):
    from agentrl.tokenizer import ChatTokenizer

    return ChatTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def sglang_server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real SGLang server on CPU serving the ``tiny`` model (shared by the whole session; a test that stops or
    signals it must leave it serving)."""
    from agentrl.engine.server import SGLangServer, SGLangServerConfig

    log = tmp_path_factory.mktemp("sglang") / "sglang.log"
    server = SGLangServer(SGLangServerConfig(model_path=str(tiny_model_path), max_total_tokens=16384,
                                                 dtype="float32"), log_path=log)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def sglang_url(sglang_server: Any) -> str:
    """URL of the session's SGLang server."""
    return str(sglang_server.url)


@pytest.fixture(scope="module")
def shared_server(sglang_url: str, tiny_model_path: Path) -> Iterator[str]:
    """The session's SGLang server for whole training runs (``engine.url``): they load their own weights into it,
    so the base weights are put back (and any pause lifted) after the module."""
    yield sglang_url
    import asyncio

    from agentrl.engine.client import SGLangClient

    async def restore() -> None:
        async with SGLangClient(sglang_url) as client:
            await client.resume()  # a run killed mid-pause (a fault test) must not leave it paused for the next
            await client.update_weights(str(tiny_model_path), 0)

    asyncio.run(restore())
