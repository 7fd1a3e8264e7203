"""Fixtures of the API tests: one real embedded Redis for the module's servers (each test uses its own key
namespace) and a factory of real uvicorn servers."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from api_support import ApiServer

from agentrl.api import ApiSettings
from agentrl.queue import EmbeddedRedis
from agentrl.sandbox import SandboxConfig


@pytest.fixture(scope="package")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with EmbeddedRedis(tmp_path_factory.mktemp("api-redis")) as server:
        yield server.url


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> ApiSettings:
    """Settings of a fresh service: its own namespace, short leases, the tmp dir for datasets and runs."""
    return ApiSettings(redis_url=redis_url, namespace=f"{{t-{uuid.uuid4().hex[:10]}}}", data_dir=tmp_path / "api",
                       runs_dir=tmp_path / "runs", dataset_dirs=[tmp_path], model_dirs=[tmp_path], lease_s=2.0, poll_s=0.1,
                       max_tasks=2, max_episodes=8, sandbox=SandboxConfig(max_concurrency=4), max_body_bytes=256 << 10)


@pytest.fixture
async def start_api() -> AsyncIterator[Callable[..., Awaitable[ApiServer]]]:
    servers: list[ApiServer] = []

    async def start(settings: ApiSettings, **kw: Any) -> ApiServer:
        server = await ApiServer(settings, **kw).start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        if s.task is not None and not s.task.done():
            await s.stop()
