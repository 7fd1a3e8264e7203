"""The Docker sandbox: a warm pool of pre-started, locked-down containers (docker SDK; blocking calls in threads).

Each container runs ``sleep infinity`` as PID 1 (immune to signals from inside) with: no network, memory
(+swap) and pids limits, a CPU quota, a read-only root, size-capped tmpfs at ``/tmp`` (exec allowed: a compiled
language's binary runs from there, as in the local sandbox; nosuid, nodev) and ``/dev/shm``, all capabilities dropped, ``no-new-privileges``, uid/gid 65534, no core dumps, a file-size cap.
One launcher (``runtime/launcher.py``) is exec'd into it when it is warmed and serves its runs over the exec's
stdin/stdout (multiplexed by Docker). Between runs the launcher kills every process but PID 1, empties
``/tmp``, ``/dev/shm`` and ``/dev/mqueue`` and checks that nothing is left; a container that is not clean,
timed out, broke the protocol or served ``max_uses`` runs is removed and replaced. A session gets a container
of its own, removed when the session ends.

Container-level limits (memory, pids, file size) are fixed when a container starts: there is one warm pool per
set of them (the default ``limits``' pool is made at start, others on first use). The pools, the runs and the
sessions are the shared core's (``_core.WarmSandbox``); this module says how one container starts and stops.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import socket
import struct
import uuid
from typing import Any

from agentrl.errors import SandboxError
from agentrl.sandbox._core import WarmSandbox
from agentrl.sandbox._wire import SANDBOX_ENV, Conn, launcher_source, ping
from agentrl.sandbox.base import Limits


def import_docker_sdk() -> Any:
    """The ``docker`` SDK module (an optional dependency: the ``[docker]`` extra), or :class:`SandboxError`."""
    try:
        docker: Any = importlib.import_module("docker")
    except ImportError:
        docker = None
    if not hasattr(docker, "from_env"):  # not installed (a checkout's docker/ folder imports as an empty package)
        raise SandboxError("the Docker backend needs the Docker SDK for Python: pip install 'agentrl[docker]' "
                           "(or pip install docker)")
    return docker


log = logging.getLogger(__name__)

DEFAULT_IMAGE = "agentrl-sandbox:bookworm"
LABEL = "agentrl.sandbox"
PIDS_OVERHEAD = 2  # PID 1 (sleep) and the launcher


class _DemuxReader:
    """Docker's multiplexed exec stream (8-byte headers: stream id, 3 zero bytes, big-endian length) as a plain
    byte reader of stdout; stderr frames (the launcher's own crash messages) are kept, bounded, in ``stderr``."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader, self._buf, self.stderr = reader, bytearray(), bytearray()

    async def readexactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            head = await self._reader.readexactly(8)
            stream, size = head[0], struct.unpack(">I", head[4:])[0]
            payload = await self._reader.readexactly(size)
            if stream == 1:
                self._buf += payload
            else:
                self.stderr = (self.stderr + payload)[-4096:]
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out


class _DockerBox:
    """One container and the launcher exec'd into it."""

    def __init__(self, container: Any, conn: Conn, writer: asyncio.StreamWriter, memory_mb: int) -> None:
        self.container, self.conn, self.writer = container, conn, writer
        self.uses, self.memory_mb = 0, memory_mb  # the container's memory limit now

    def alive(self) -> bool:
        return True  # a dead launcher shows as a broken stream at its next run (then it is replaced once)

    def oom_kills(self) -> int:
        return 0  # Docker reports OOM per container, not per process; the kill signal says enough

    async def destroy(self) -> None:
        self.writer.close()
        try:
            await asyncio.to_thread(self.container.remove, force=True)
        except Exception as exc:  # already gone, or the engine is down: nothing more to do here
            log.debug("removing container %s: %r", self.container.short_id, exc)


class DockerSandbox(WarmSandbox[_DockerBox]):
    """Sandbox backend on a Docker engine. Same knobs as LocalSandbox, plus ``image``, ``runtime`` (e.g.
    ``"runsc"`` for gVisor), ``limits`` (the container-level limits of the main warm pool), and the engine:
    ``base_url`` or a docker ``client`` (default: ``docker.from_env()``)."""

    kind = "docker"

    def __init__(self, image: str = DEFAULT_IMAGE, *, max_concurrency: int = 8, pool_size: int | None = None,
                 max_sessions: int = 32, session_idle_s: float = 600.0, session_wait_s: float = 60.0,
                 limits: Limits | None = None, cpus: float = 1.0, scratch_mb: int = 64, runtime: str | None = None,
                 base_url: str | None = None, client: Any = None, start_timeout_s: float = 30.0, grace_s: float = 2.0,
                 max_uses: int = 200, max_starting: int = 4) -> None:
        super().__init__(limits=limits or Limits(), max_concurrency=max_concurrency, pool_size=pool_size,
                         max_sessions=max_sessions, session_idle_s=session_idle_s, session_wait_s=session_wait_s,
                         start_timeout_s=start_timeout_s, grace_s=grace_s, max_uses=max_uses,
                         max_starting=max_starting)
        self.image, self.runtime, self.cpus, self.scratch_mb = image, runtime, cpus, scratch_mb
        self._client, self._base_url, self._owns_client = client, base_url, client is None
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    def _pool_key(self, limits: Limits) -> tuple[int, int, int]:
        return (limits.memory_mb, limits.pids, limits.file_size_mb)

    # ------------------------------------------------------------------------------------------- set-up

    async def _setup(self) -> None:
        """Connect to the engine, check the image, remove containers left by dead owners."""
        await asyncio.to_thread(self._connect)

    def _connect(self) -> None:
        docker = import_docker_sdk()
        try:
            if self._client is None and self._base_url is not None:
                self._client = docker.DockerClient(  # type: ignore[attr-defined]
                    base_url=self._base_url, timeout=60, max_pool_size=32)
            elif self._client is None:
                self._client = docker.from_env(timeout=60, max_pool_size=32)  # type: ignore[attr-defined]
            self._client.ping()
        except Exception as exc:
            raise SandboxError(f"no Docker engine is reachable ({exc}): start one with scripts/ensure_docker.sh, "
                               "or use the local backend") from None
        try:
            self._client.images.get(self.image)
        except docker.errors.ImageNotFound:  # type: ignore[attr-defined]
            raise SandboxError(f"the sandbox image {self.image!r} is missing: build it with "
                               "scripts/build_sandbox_image.sh (offline) or `docker build -t "
                               f"{self.image} docker/`") from None
        self._sweep_stale()

    def _sweep_stale(self) -> None:
        host, api = socket.gethostname(), self._client.api
        for c in api.containers(all=True, filters={"label": LABEL}):
            owner = (c.get("Labels") or {}).get(LABEL, "")
            parts = owner.split(":")
            if len(parts) == 3 and parts[0] == host and parts[1].isdigit() and int(parts[1]) != os.getpid() \
                    and not os.path.exists(f"/proc/{parts[1]}"):
                log.info("removing container %s left by a dead sandbox owner (%s)", c["Id"][:12], owner)
                try:
                    api.remove_container(c["Id"], force=True)
                except Exception as exc:  # removed meanwhile by another sweeper
                    log.debug("removing %s: %r", c["Id"][:12], exc)

    def _create(self, limits: Limits) -> Any:
        from docker.types import Ulimit

        mem, fsize = f"{limits.memory_mb}m", limits.file_size_mb << 20
        return self._client.containers.run(
            self.image, ["sleep", "infinity"], detach=True, network_mode="none", mem_limit=mem,
            memswap_limit=mem, pids_limit=limits.pids + PIDS_OVERHEAD, nano_cpus=int(self.cpus * 1e9),
            read_only=True, cap_drop=["ALL"], security_opt=["no-new-privileges"], user="65534:65534",
            tmpfs={"/tmp": f"rw,exec,size={self.scratch_mb}m,nosuid,nodev"}, shm_size=f"{self.scratch_mb}m",
            ipc_mode="private", working_dir="/tmp", environment=SANDBOX_ENV, runtime=self.runtime,
            ulimits=[Ulimit(name="fsize", soft=fsize, hard=fsize), Ulimit(name="core", soft=0, hard=0)],
            labels={LABEL: self.owner}, stdin_open=False, tty=False)

    def _exec_launcher(self, container: Any) -> socket.socket:
        api = self._client.api
        exec_id = api.exec_create(container.id, ["python3", "-I", "-c", launcher_source()], stdin=True,
                                  stdout=True, stderr=True, user="65534:65534", workdir="/tmp",
                                  environment=SANDBOX_ENV)["Id"]
        sdk_sock = api.exec_start(exec_id, socket=True)
        raw = getattr(sdk_sock, "_sock", sdk_sock)
        own = socket.socket(fileno=os.dup(raw.fileno()))  # ours to close, whatever the SDK's objects do
        sdk_sock.close()
        raw.close()
        return own

    async def _spawn(self, limits: Limits) -> _DockerBox:
        try:
            container = await asyncio.to_thread(self._create, limits)
        except Exception as exc:
            raise SandboxError(f"could not start a sandbox container from {self.image!r}: {exc}") from None
        writer = None
        try:
            async with asyncio.timeout(self._start_timeout_s):
                sock = await asyncio.to_thread(self._exec_launcher, container)
                reader, writer = await asyncio.open_connection(sock=sock)
                box = _DockerBox(container, Conn(_DemuxReader(reader), writer), writer, limits.memory_mb)
                await ping(box.conn)
        except Exception as exc:
            if writer is not None:
                writer.close()
            await asyncio.to_thread(container.remove, force=True)
            raise SandboxError(f"the sandbox container did not start its launcher: {exc!r}") from None
        return box

    async def _prepare(self, worker: _DockerBox, limits: Limits) -> None:
        """A compiled language's compile step gets more memory than the program (``compile_memory_mb``): the
        running container's limit is raised for it and lowered back before the program starts (``docker
        update``; refused, as OSError, when the container already uses more). Pids and file size stay the
        container's."""
        if limits.memory_mb == worker.memory_mb:
            return
        mem = f"{limits.memory_mb}m"
        try:
            await asyncio.to_thread(worker.container.update, mem_limit=mem, memswap_limit=mem)
        except Exception as exc:  # the engine's APIError: e.g. below the container's current usage
            raise OSError(f"docker update of the container's memory to {mem} failed: {exc}") from None
        worker.memory_mb = limits.memory_mb

    # ------------------------------------------------------------------------------------------- teardown

    def leftover_containers(self) -> list[str]:
        if self._client is None:
            return []
        return [c["Id"] for c in self._client.api.containers(all=True, filters={"label": f"{LABEL}={self.owner}"})]

    async def _teardown(self) -> None:
        """Remove what is left of this sandbox's containers; close the engine client if it is ours."""
        if self._client is not None:
            try:
                leftovers = await asyncio.to_thread(self.leftover_containers)
            except Exception as exc:  # the engine went away: nothing to remove through it
                log.warning("could not list this sandbox's containers: %r", exc)
                leftovers = []
            for cid in leftovers:
                try:
                    await asyncio.to_thread(self._client.api.remove_container, cid, force=True)
                except Exception as exc:  # removed meanwhile
                    log.debug("removing %s: %r", cid[:12], exc)
            if self._owns_client:
                client, self._client = self._client, None
                await asyncio.to_thread(client.close)
