"""Hostile programs against the local and Docker backends: resource exhaustion, escape attempts, orphans,
concurrency; then a check that nothing is left on the host. Every bomb is preceded, in the same test, by a benign
probe proving the limit that contains it holds in that backend (no bomb runs against an unproven limit)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sandbox_support import ISOLATED, HostCanary, make_backend, own_descendants, processes_with, require_docker

from agentrl.sandbox.base import Limits, RequestStatus, RunRequest, RunResult, RunStatus, Sandbox

MARK = f"{os.getpid() % 1000}.{int.from_bytes(os.urandom(2), 'big')}"  # unique sleep durations mark our processes
BEFORE: dict[int, set[int]] = {}  # our descendants before each sandbox started
SMALL = Limits(time_s=3.0, memory_mb=128, pids=32, file_size_mb=4, output_bytes=4096)


@pytest.fixture(scope="module", params=ISOLATED)
async def adv(request: pytest.FixtureRequest) -> AsyncIterator[Sandbox]:
    before = {p.pid for p in own_descendants()}
    opts: dict[str, object] = {"limits": SMALL} if request.param == "docker" else {}  # its warm pool's limits
    sb, _ = await make_backend(request.param, max_concurrency=8, pool_size=2, **opts)
    BEFORE[id(sb)] = before
    try:
        yield sb
    finally:
        await sb.aclose()


async def run(sb: Sandbox, code: str, limits: Limits = SMALL, language: str = "python") -> RunResult:
    r = await sb.run(RunRequest(code=code, language=language, limits=limits))
    assert not r.is_sandbox_error, r
    return r


async def assert_healthy(sb: Sandbox) -> None:
    r = await run(sb, "print('ok')")
    assert (r.status, r.stdout) == (RequestStatus.SUCCESS, "ok\n"), r


# ------------------------------------------------------------------------------------------ resource exhaustion


async def test_cpu_loop_is_killed(adv: Sandbox) -> None:
    r = await run(adv, "while True: pass", Limits(time_s=1.0))
    assert r.run_status is RunStatus.TIME_LIMIT_EXCEEDED
    await assert_healthy(adv)


async def test_memory_bomb_is_contained(adv: Sandbox) -> None:
    probe = await run(adv, "b = bytearray(64 << 20); print('fits')")
    assert probe.stdout == "fits\n", probe  # under the limit: allowed
    over = await run(adv, "b = bytearray(400 << 20); print('escaped')")
    assert over.status is RequestStatus.FAILED and "escaped" not in over.stdout, over  # over: refused
    bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))"
    r = await run(adv, bomb)
    assert r.status is RequestStatus.FAILED and r.run_status is not RunStatus.FINISHED, r
    await assert_healthy(adv)


async def test_fork_bomb_is_contained(adv: Sandbox) -> None:
    probe = ("import subprocess\nps = []\ntry:\n    for i in range(60):\n        ps.append(subprocess.Popen(['sleep', '5']))\n"
             "except OSError as e:\n    print('refused at', len(ps))\nelse:\n    print('NOT LIMITED', len(ps))\n"
             "for p in ps: p.kill()")
    r = await run(adv, probe, Limits(time_s=5.0, pids=16))
    assert r.stdout.startswith("refused at") and int(r.stdout.split()[-1]) <= 16, r
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    r = await run(adv, bomb, Limits(time_s=2.0, pids=32))
    assert r.status is RequestStatus.FAILED, r
    r = await run(adv, ":(){ :|:& };:\nsleep 5", Limits(time_s=2.0, pids=32), language="bash")
    assert r.status is RequestStatus.FAILED, r
    await assert_healthy(adv)


async def test_disk_fill_is_contained(adv: Sandbox) -> None:
    code = """
import errno, os
def fill(path):
    try:
        with open(path, 'wb') as f:
            for _ in range(1024):
                f.write(b'x' * (1 << 20)); f.flush()
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
    return 'FILLED'
print('big', fill('/tmp/big'))
print('many', [fill(f'/tmp/f{i}') for i in range(40)][-1])
print('shm', fill('/dev/shm/x'))
for p in ('/x', '/usr/x', '/usr/local/x', '/etc/x', '/dev/x', '/home/x', '/root/x', '/var/tmp/x', '/run/x'):
    print(p, fill(p))
"""
    r = await run(adv, code, Limits(time_s=20, memory_mb=256, file_size_mb=4))
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert lines["big"] == "EFBIG", r  # the per-file cap
    assert lines["many"] in ("ENOSPC", "EFBIG") and lines["shm"] in ("ENOSPC", "EFBIG"), r
    for p in ("/x", "/usr/x", "/usr/local/x", "/etc/x", "/dev/x", "/home/x", "/root/x", "/var/tmp/x", "/run/x"):
        assert lines[p] in ("EROFS", "ENOENT", "EACCES"), (p, r.stdout)
    await assert_healthy(adv)


async def test_output_flood_is_cut(adv: Sandbox) -> None:
    r = await run(adv, "import sys\nwhile True:\n    sys.stdout.write('y' * 65536)", Limits(time_s=1.5, output_bytes=4096))
    assert r.run_status is RunStatus.TIME_LIMIT_EXCEEDED
    assert len(r.stdout) < 4200 and "output truncated" in r.stdout
    r = await run(adv, "yes flood | head -c 50000000; echo done >&2", Limits(output_bytes=1000), language="bash")
    assert r.status is RequestStatus.SUCCESS and "output truncated, 49999000 more bytes" in r.stdout, r
    await assert_healthy(adv)


# ------------------------------------------------------------------------------------------ escape attempts


async def test_no_network_not_even_host_loopback(adv: Sandbox, host_canary: HostCanary) -> None:
    code = f"""
import socket
try:
    socket.create_connection(('127.0.0.1', {host_canary.port}), timeout=1).close()
    print('CONNECTED')
except OSError as e:
    print(type(e).__name__)
print(sorted(n for _, n in socket.if_nameindex()))
"""
    r = await run(adv, code)
    first, names = r.stdout.splitlines()
    assert first != "CONNECTED" and names == "['lo']", r  # its own loopback, no other device
    with pytest.raises(BlockingIOError):
        host_canary.listener.accept()  # nothing reached the host's service


@pytest.mark.parametrize("backend", ISOLATED)
def test_no_route_to_a_host_outside(backend: str) -> None:
    """The "outside" is an address of ours in a private network namespace this test makes (see outside_probe.py):
    reachable there without a sandbox (the positive control), unreachable from the sandbox started there, and
    nothing can leave the machine either way."""
    if backend == "docker":
        require_docker()
    unshare = ["unshare", "--net", *([] if os.geteuid() == 0 else ["--map-root-user"])]
    probe = Path(__file__).with_name("outside_probe.py")
    out = subprocess.run([*unshare, sys.executable, str(probe), backend], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"the probe failed (can this user make a network namespace?):\n{out.stderr[-3000:]}"
    result = json.loads(out.stdout.splitlines()[-1])
    assert (result["control"], result["control_accepted"]) == ("['lo']\nCONNECTED\n", True), result
    # only loopback, and no route to the address at all (a refused or timed-out connection would mean a route)
    assert (result["sandbox"], result["sandbox_status"]) == ("['lo']\nOSError\n", "Success"), result
    assert result["sandbox_accepted"] is False, result


async def test_host_files_and_environment_are_invisible(adv: Sandbox, host_canary: HostCanary) -> None:
    code = f"""
import os
print(os.environ.get('AGENTRL_TEST_CANARY'), sorted(os.environ))
for p in ({host_canary.path!r}, '/etc/shadow', '/root', '/home', '/work', '/var/run/docker.sock', '/proc/1/environ'):
    try:
        data = open(p, 'rb').read() if not os.path.isdir(p) else os.listdir(p)
        print(p, 'READ', {host_canary.secret!r} in str(data))
    except OSError as e:
        print(p, type(e).__name__)
"""
    r = await run(adv, code)
    assert host_canary.secret not in r.stdout.replace(repr(host_canary.secret), ""), r
    first = r.stdout.splitlines()[0]
    assert first.startswith("None ") and "AGENTRL" not in first, r
    for line in r.stdout.splitlines()[1:]:
        assert "READ True" not in line, line
        path = line.split()[0]
        if path in (host_canary.path, "/etc/shadow", "/root", "/work", "/var/run/docker.sock"):
            assert line.endswith(("FileNotFoundError", "PermissionError")), line


async def test_host_processes_are_invisible_and_unreachable(adv: Sandbox, host_canary: HostCanary) -> None:
    code = f"""
import os, signal
pids = [int(p) for p in os.listdir('/proc') if p.isdigit()]
print(len(pids), {host_canary.pid} in pids)
for target in ({host_canary.pid}, 1):
    try:
        os.kill(target, signal.SIGKILL)
        print(target, 'SENT')
    except OSError as e:
        print(target, type(e).__name__)
"""
    r = await run(adv, code)
    lines = r.stdout.splitlines()
    count, seen = lines[0].split()
    assert int(count) <= 6 and seen == "False", r
    assert lines[1].endswith(("ProcessLookupError", "PermissionError")), r
    r = await run(adv, "import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('survived')")  # kills its launcher
    assert r.status is RequestStatus.FAILED and r.stdout == "", r  # the program's failure, not the sandbox's
    assert os.path.exists(f"/proc/{host_canary.pid}"), "the host process was killed"
    await assert_healthy(adv)


async def test_no_privileges_to_gain(adv: Sandbox) -> None:
    code = """
import ctypes, os
status = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)
print(os.getuid(), os.geteuid(), os.getgid(), status['CapEff'].strip(), status['NoNewPrivs'].strip())
for f in (lambda: os.setuid(0), lambda: os.setgid(0)):
    try:
        f(); print('GAINED')
    except OSError as e:
        print(type(e).__name__)
libc = ctypes.CDLL(None, use_errno=True)
print('unshare', libc.unshare(0x10000000))  # CLONE_NEWUSER
try:
    open(f'/proc/{os.getppid()}/mem', 'rb').read(1); print('LAUNCHER MEMORY READ')
except OSError as e:
    print(type(e).__name__)
"""
    r = await run(adv, code)
    lines = r.stdout.splitlines()
    assert lines[0] == "65534 65534 65534 0000000000000000 1", r
    assert lines[1] in ("PermissionError", "OSError") and lines[2] in ("PermissionError", "OSError"), r
    assert lines[3] == "unshare -1", r
    assert lines[4] in ("PermissionError", "OSError"), r


# ------------------------------------------------------------------------------------------ orphans, concurrency


async def test_orphans_die_with_the_run(adv: Sandbox) -> None:
    daemon = f"import subprocess\nsubprocess.Popen(['sleep', '{MARK}1'], start_new_session=True)\n"
    r = await run(adv, daemon + "print('spawned')")
    assert r.stdout == "spawned\n", r
    r = await run(adv, daemon.replace(f"{MARK}1", f"{MARK}2") + "while True: pass", Limits(time_s=1.0))
    assert r.run_status is RunStatus.TIME_LIMIT_EXCEEDED
    r = await run(adv, f"sleep {MARK}3 &\ndisown\nsetsid sleep {MARK}4 &\necho ok", language="bash")
    assert r.stdout == "ok\n", r
    for _ in range(100):
        if not processes_with(MARK):
            break
        await asyncio.sleep(0.05)
    assert processes_with(MARK) == [], "orphaned sandbox processes survived their run"


async def test_32_concurrent_runs_each_get_their_own_output(adv: Sandbox) -> None:
    code = "import sys, time\ntoken = sys.stdin.read().strip()\ntime.sleep(0.05)\nprint(token * 3)"
    requests = [RunRequest(code=code, stdin=f"t{i:02d}-", limits=SMALL) for i in range(32)]
    results = await asyncio.gather(*(adv.run(r) for r in requests))
    assert [r.stdout for r in results] == [f"t{i:02d}-" * 3 + "\n" for i in range(32)]


async def test_zz_nothing_left_on_the_host(adv: Sandbox) -> None:
    await assert_healthy(adv)
    await adv.aclose()
    tree = getattr(getattr(adv, "_cgroups", None), "_tag", None)  # this sandbox's cgroups: agentrl-<pid>-<id>-
    for _ in range(100):
        # the session-scoped contract sandboxes (tests/sandbox/conftest.py) are alive too and may still refill their
        # warm pools after BEFORE was taken: a process in another sandbox's cgroups is theirs, not this one's
        extra = [p for p in own_descendants() if p.pid not in BEFORE[id(adv)] and not in_other_tree(p.pid, tree)]
        if not extra:
            break
        await asyncio.sleep(0.05)
    assert extra == [], "processes of the closed sandbox are still alive"
    assert processes_with(MARK) == []
    leftover_cgroups = getattr(adv, "leftover_cgroups", None)
    if leftover_cgroups is not None:
        assert leftover_cgroups() == []
    if hasattr(adv, "owner"):
        import docker

        client = docker.from_env()
        try:
            assert client.api.containers(all=True, quiet=True, filters={"label": f"agentrl.sandbox={adv.owner}"}) == []
        finally:
            client.close()


def in_other_tree(pid: int, tree: str | None) -> bool:
    """Whether process ``pid`` is in the cgroups of a local sandbox other than the one whose tag is ``tree`` (None:
    the sandbox under test has no cgroups of its own, e.g. Docker's)."""
    try:
        groups = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False
    return "/agentrl-" in groups and (tree is None or tree not in groups)
