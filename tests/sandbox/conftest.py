"""Sandbox fixtures: real backends only (bubblewrap, a Docker engine, a real uvicorn server on a free port).

``sandbox`` is parametrized over ``local``, ``docker``, ``remote`` (an HTTP server wrapping a local
sandbox) and ``fleet`` (a SandboxFleet over two such servers); the docker case is marked ``docker`` and skipped, with the reason, only when no engine answers.
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psutil
import pytest
from sandbox_support import BACKENDS, HostCanary, make_backend

from agentrl.sandbox.base import Sandbox


@pytest.fixture(scope="session", params=BACKENDS)
async def sandbox(request: pytest.FixtureRequest) -> AsyncIterator[Sandbox]:
    sb, server = await make_backend(request.param, max_concurrency=8, session_idle_s=120.0)
    try:
        yield sb
    finally:
        await sb.aclose()
        if server is not None:
            await server.stop()


@pytest.fixture
def host_canary(tmp_path: Path) -> Iterator[HostCanary]:
    """A secret in the host's environment, a file in the host's /tmp, a host process, a host TCP service."""
    secret = os.urandom(8).hex()
    path = tmp_path / "canary.txt"
    path.write_text(secret)
    os.environ["AGENTRL_TEST_CANARY"] = secret
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    proc = psutil.Popen(["sleep", "300"])
    try:
        yield HostCanary(secret, str(path), listener.getsockname()[1], proc.pid, listener)
    finally:
        os.environ.pop("AGENTRL_TEST_CANARY", None)
        proc.kill()
        proc.wait()
        listener.close()
