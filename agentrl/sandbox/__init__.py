"""Sandboxes: run untrusted code under hard limits (local bubblewrap, Docker warm pool, or a remote server).

    sandbox = make_sandbox("local")  # or "docker", "remote" (url=... or urls=[...]), "auto"; or SandboxConfig(...).build()
    async with sandbox:
        result = await sandbox.run(RunRequest(code="print(1)", limits=Limits(time_s=5)))
        async with await sandbox.session("python", Limits(time_s=5)) as s:
            await s.run("x = 1"); await s.run("print(x)")

The public names load on first use (``agentrl._lazy``): the backends import their dependencies (docker, aiohttp)
only when used, and a run's configuration reads :class:`SandboxConfig` without the sandbox.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentrl._lazy import lazy_exports
from agentrl.errors import ConfigError, SandboxError

if TYPE_CHECKING:
    from agentrl.sandbox.base import Limits, RequestStatus, RunRequest, RunResult, RunStatus, Sandbox, Session
    from agentrl.sandbox.config import SandboxConfig
    from agentrl.sandbox.docker import DockerSandbox
    from agentrl.sandbox.fleet import SandboxFleet
    from agentrl.sandbox.local import LocalSandbox
    from agentrl.sandbox.remote import RemoteSandbox
    from agentrl.sandbox.server import create_app

BACKENDS = ("local", "docker", "remote", "auto")

_HOME = {
    **dict.fromkeys(["Limits", "RequestStatus", "RunRequest", "RunResult", "RunStatus", "Sandbox", "Session"], "base"),
    "SandboxConfig": "config",
    "SandboxFleet": "fleet",
    "DockerSandbox": "docker",
    "LocalSandbox": "local",
    "RemoteSandbox": "remote",
    "create_app": "server",
}


def docker_available(timeout_s: float = 3.0) -> str | None:
    """None if a Docker engine answers here, else why not (a message for humans)."""
    from agentrl.sandbox.docker import import_docker_sdk

    try:
        client = import_docker_sdk().from_env(timeout=timeout_s)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:
        return f"no Docker engine is reachable: {exc}"
    return None


def make_sandbox(backend: str, **opts: Any) -> Sandbox:
    """A sandbox backend by name: ``local`` (bubblewrap), ``docker`` (warm container pool), ``remote`` (a
    sandbox server, ``url=``; or a fleet of them, ``urls=[...]``), ``auto`` (docker if an engine answers, else
    local). ``opts`` go to the backend's constructor. Nothing starts until the first use (or ``async with``)."""
    if backend == "auto":
        backend = "docker" if docker_available() is None else "local"
    if backend == "local":
        from agentrl.sandbox.local import LocalSandbox

        return LocalSandbox(**opts)
    if backend == "docker":
        from agentrl.sandbox.docker import DockerSandbox

        return DockerSandbox(**opts)
    if backend == "remote" and "urls" in opts:
        from agentrl.sandbox.fleet import SandboxFleet

        return SandboxFleet(**opts)
    if backend == "remote":
        from agentrl.sandbox.remote import RemoteSandbox

        return RemoteSandbox(**opts)
    raise ConfigError(f"sandbox backend must be one of {BACKENDS}, got {backend!r}")


__all__ = [
    "BACKENDS", "DockerSandbox", "Limits", "LocalSandbox", "RemoteSandbox", "RequestStatus", "RunRequest",
    "RunResult", "RunStatus", "Sandbox", "SandboxConfig", "SandboxError", "SandboxFleet", "Session", "create_app",
    "docker_available", "make_sandbox",
]

__getattr__, __dir__ = lazy_exports(__name__, _HOME)
