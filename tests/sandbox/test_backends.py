"""What is particular to each backend: set-up errors, rlimit-only mode, session caps and idle expiry, warm
sandboxes that die while idle, containers that misbehave, a reused container that starts clean, how many workers
start at once."""

from __future__ import annotations

import asyncio

import psutil
import pytest
from sandbox_support import require_docker

from agentrl.errors import SandboxError
from agentrl.sandbox._core import WarmSandbox
from agentrl.sandbox.base import Limits, RequestStatus, RunRequest, RunStatus, Sandbox
from agentrl.sandbox.local import LocalSandbox


def test_missing_bubblewrap_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxError, match="apt-get install bubblewrap"):
        LocalSandbox()


async def test_rlimits_alone_still_bound_memory_time_and_files() -> None:
    async with LocalSandbox(use_cgroups=False, max_concurrency=2) as sb:
        assert sb.leftover_cgroups() == []
        small = Limits(time_s=5, memory_mb=128, file_size_mb=2)
        r = await sb.run(RunRequest(code="b = bytearray(300 << 20)\nprint('escaped')", limits=small))
        assert r.status is RequestStatus.FAILED and "MemoryError" in r.stderr, r
        r = await sb.run(RunRequest(code="open('/tmp/f', 'wb').write(b'x' * (3 << 20))", limits=small))
        assert r.status is RequestStatus.FAILED, r
        r = await sb.run(RunRequest(code="while True: pass", limits=Limits(time_s=1)))
        assert r.run_status is RunStatus.TIME_LIMIT_EXCEEDED
        assert (await sb.run(RunRequest(code="print(2 ** 10)"))).stdout == "1024\n"


async def test_session_cap_and_idle_expiry() -> None:
    async with LocalSandbox(max_concurrency=1, max_sessions=1, session_wait_s=0.3, session_idle_s=0.5) as sb:
        s = await sb.session()
        with pytest.raises(SandboxError, match="sessions stayed in use"):
            await sb.session()
        await asyncio.sleep(1.0)  # idle past session_idle_s: closed, and its slot is free again
        r = await s.run("print(1)")
        assert r.is_sandbox_error and "idle" in r.message
        s2 = await sb.session()
        assert (await s2.run("print(2)")).stdout == "2\n"
        await s2.aclose()


def live_boxes(sb: LocalSandbox) -> set[frozenset[int]]:
    """The processes of each of the sandbox's live boxes (one cgroup per box and controller hierarchy)."""
    out = set()
    for d in sb.leftover_cgroups():
        try:
            procs = frozenset(int(p) for p in (d / "cgroup.procs").read_text().split())
        except OSError:  # removed while we listed it
            continue
        if procs:
            out.add(procs)
    return out


async def test_warm_sandboxes_killed_while_idle_are_replaced() -> None:
    async with LocalSandbox(max_concurrency=2, pool_size=2) as sb:
        assert (await sb.run(RunRequest(code="print(1)"))).stdout == "1\n"
        async with asyncio.timeout(30):  # the pool refills: two warm sandboxes, the used one gone
            while len(live_boxes(sb)) != 2:
                await asyncio.sleep(0.02)
        pids = set().union(*live_boxes(sb))
        assert pids, "expected warm sandboxes in this sandbox's cgroups"
        for pid in pids:  # this sandbox's warm processes only (others may run in this test session)
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        r = await sb.run(RunRequest(code="print('replaced')"))
        assert (r.status, r.stdout) == (RequestStatus.SUCCESS, "replaced\n"), r


def cannot_start(backend: str) -> tuple[Sandbox, str]:
    """A backend whose start fails for real, and a word its message must hold."""
    from agentrl.sandbox.docker import DockerSandbox

    if backend == "local":
        sb = LocalSandbox(max_concurrency=1)
        sb.bwrap = "/bin/false"  # answers --help, then exits at once instead of starting a sandbox
        return sb, "did not start"
    if backend == "docker-no-engine":
        return DockerSandbox(base_url="unix:///nonexistent/docker.sock"), "ensure_docker.sh"
    require_docker()
    return DockerSandbox(image="agentrl-sandbox:no-such-tag", max_concurrency=1), "build_sandbox_image.sh"


@pytest.mark.parametrize("backend", ["local", "docker-no-engine",
                                     pytest.param("docker-no-image", marks=pytest.mark.docker)])
async def test_a_sandbox_that_cannot_start_answers_a_sandbox_error_result(backend: str) -> None:
    # One behaviour for every backend: a run gets the same SandboxError result shape (never an exception, never
    # the program's Failed), again on the next call (start is retried); session() and start() raise SandboxError.
    sb, hint = cannot_start(backend)
    try:
        for _ in range(2):
            r = await sb.run(RunRequest(code="print(1)"))
            assert (r.status, r.run_status, r.exit_code, r.stdout, r.stderr, dict(r.files)) == \
                (RequestStatus.SANDBOX_ERROR, None, None, "", "", {}), r
            assert hint in r.message, r.message
        with pytest.raises(SandboxError, match=hint):
            await sb.session()
        with pytest.raises(SandboxError, match=hint):
            await sb.start()  # type: ignore[attr-defined]
    finally:
        await sb.aclose()


@pytest.mark.docker
async def test_a_misbehaving_container_is_replaced() -> None:
    require_docker()
    import docker
    from agentrl.sandbox.docker import DockerSandbox

    client = docker.from_env()
    try:
        async with DockerSandbox(max_concurrency=1, pool_size=1) as sb:
            code = "import socket\nprint(socket.gethostname(), flush=True)\nwhile True: pass"
            r = await sb.run(RunRequest(code=code, limits=Limits(time_s=1)))
            assert r.run_status is RunStatus.TIME_LIMIT_EXCEEDED
            timed_out = r.stdout.strip()
            r = await sb.run(RunRequest(code="import socket\nprint(socket.gethostname())"))
            assert r.status is RequestStatus.SUCCESS and r.stdout.strip() != timed_out
            for _ in range(100):
                if not client.api.containers(all=True, quiet=True, filters={"id": timed_out}):
                    break
                await asyncio.sleep(0.1)
            assert client.api.containers(all=True, quiet=True, filters={"id": timed_out}) == []
    finally:
        client.close()


class _IdleWorker:
    def __init__(self) -> None:
        self.uses, self.conn = 0, None

    def alive(self) -> bool:
        return True

    def oom_kills(self) -> int:
        return 0

    async def destroy(self) -> None:
        pass


class _CountingStarts(WarmSandbox[_IdleWorker]):  # type: ignore[type-var]
    """The warm core over workers that take 20 ms to start; counts how many start at once."""

    def __init__(self, max_starting: int) -> None:
        super().__init__(limits=Limits(), max_concurrency=1, pool_size=12, max_sessions=1, session_idle_s=60.0,
                         session_wait_s=1.0, start_timeout_s=5.0, grace_s=1.0, max_uses=10, max_starting=max_starting)
        self.now = self.peak = 0

    async def _setup(self) -> None:
        pass

    async def _spawn(self, limits: Limits) -> _IdleWorker:
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await asyncio.sleep(0.02)
        finally:
            self.now -= 1
        return _IdleWorker()


@pytest.mark.parametrize(("max_starting", "peak"), [(3, 3), (100, 11)])
async def test_workers_start_at_most_max_starting_at_once(max_starting: int, peak: int) -> None:
    sb = _CountingStarts(max_starting)
    try:
        await sb.start()  # one worker to prove it works, then 11 more in the background to fill the pool
        async with asyncio.timeout(10):
            while sb._pools[None].ready < 12:
                await asyncio.sleep(0.01)
        assert sb.peak == peak
    finally:
        await sb.aclose()


@pytest.mark.docker
async def test_a_reused_container_starts_clean() -> None:
    # One warm container: run 2 lands in the container run 1 used (same hostname, the container's id), and sees
    # none of what run 1 left: files in /tmp and /dev/shm, a detached process, its environment.
    require_docker()
    from agentrl.sandbox.docker import DockerSandbox

    dirty = ("import os, socket, subprocess\nopen('/tmp/left.txt', 'w').write('x')\n"
             "open('/dev/shm/left', 'w').write('x')\nos.environ['LEFT_BY_RUN_1'] = '1'\n"
             "subprocess.Popen(['sleep', '300'], start_new_session=True, env=dict(os.environ))\n"
             "print(socket.gethostname())")
    check = ("import os, socket\ncmds = []\nfor p in os.listdir('/proc'):\n"
             "    if p.isdigit() and int(p) != os.getpid():\n        try:\n"
             "            cmds.append(open(f'/proc/{p}/cmdline', 'rb').read().replace(b'\\0', b' ').decode())\n"
             "        except OSError:\n            pass\n"
             "print(socket.gethostname(), os.path.exists('/tmp/left.txt'), os.listdir('/dev/shm'),\n"
             "      'LEFT_BY_RUN_1' in os.environ, any('sleep 300' in c for c in cmds))")
    async with DockerSandbox(max_concurrency=1, pool_size=1) as sb:
        r1 = await sb.run(RunRequest(code=dirty))
        assert r1.status is RequestStatus.SUCCESS, r1
        r2 = await sb.run(RunRequest(code=check))
        assert r2.status is RequestStatus.SUCCESS, r2
        assert r2.stdout.split() == [r1.stdout.strip(), "False", "[]", "False", "False"], (r1.stdout, r2.stdout)
