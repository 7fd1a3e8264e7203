"""Helpers for the sandbox tests (imported by conftest.py and the test modules)."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

import psutil
import pytest

from agentrl.sandbox import docker_available
from agentrl.sandbox.base import Sandbox

BACKENDS = ["local", pytest.param("docker", marks=pytest.mark.docker), "remote", "fleet"]
ISOLATED = ["local", pytest.param("docker", marks=pytest.mark.docker)]


def require_docker() -> None:
    why = docker_available()
    if why is not None:
        pytest.skip(f"{why} (CI starts one with scripts/ensure_docker.sh)")


class ServerHandle:
    """A real uvicorn server on 127.0.0.1:<free port> in this event loop."""

    def __init__(self, app: object) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> ServerHandle:
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))
        for _ in range(500):
            if self.server.started:
                return self
            await asyncio.sleep(0.01)
        raise RuntimeError("uvicorn did not start")

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task
        self.sock.close()


class Servers:
    """Several servers, stopped together."""

    def __init__(self, *handles: ServerHandle) -> None:
        self.handles = handles

    async def stop(self) -> None:
        for h in self.handles:
            await h.stop()


async def make_backend(name: str, **opts: object) -> tuple[Sandbox, ServerHandle | Servers | None]:
    """A started sandbox of kind ``name``; for ``remote`` also the server (wrapping a local sandbox), for ``fleet``
    the two servers of a SandboxFleet (each wrapping a local sandbox of its own)."""
    from agentrl.sandbox import make_sandbox
    from agentrl.sandbox.server import create_app

    if name == "docker":
        require_docker()
    if name not in ("remote", "fleet"):
        sandbox = make_sandbox(name, **opts)
        await sandbox.start()  # type: ignore[attr-defined]
        return sandbox, None
    handles = []
    for _ in range(1 if name == "remote" else 2):
        inner = make_sandbox("local", **opts)
        await inner.start()  # type: ignore[attr-defined]
        handles.append(await ServerHandle(create_app(inner, max_concurrency=8, max_queue=128, token="test-token",
                                                     close_sandbox=True)).start())
    if name == "remote":
        return make_sandbox("remote", url=handles[0].url, token="test-token"), handles[0]
    return make_sandbox("remote", urls=[h.url for h in handles], token="test-token"), Servers(*handles)


@dataclass
class HostCanary:
    secret: str  # also in the host's environment as AGENTRL_TEST_CANARY
    path: str  # a file holding the secret in the host's /tmp
    port: int  # a TCP service on the host's 127.0.0.1
    pid: int  # a host process
    listener: socket.socket


def own_descendants() -> list[psutil.Process]:
    """Processes below this test process (a sandbox leaves none once closed)."""
    out = []
    try:
        children = psutil.Process().children(recursive=True)
    except (psutil.Error, OSError):  # one vanished while listing: list again
        children = psutil.Process().children(recursive=True)
    for p in children:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def processes_with(marker: str) -> list[int]:
    """Host processes whose command line contains ``marker`` (sandboxed or not)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(p.info["cmdline"] or ()):
                found.append(p.pid)
        except psutil.Error:
            pass
    return found
