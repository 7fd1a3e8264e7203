"""Sandbox latency and throughput for a trivial program (``print(1)``), each against a floor doing the same work.

- floor:  the same fork-server launcher (``agentrl/sandbox/runtime/launcher.py``, the same warm pool, the same
  wire protocol) **without** bubblewrap (only a PID namespace, which the launcher's clean-up needs), cgroups or
  the /proc and IPC leftover check: :class:`BareLauncher` below.
  ``local_vs_floor`` (p50 latency, local / floor) is then what the isolation costs per run;
- local:  ``LocalSandbox.run`` (bubblewrap + cgroups + rlimits, warm pool);
- fresh:  ``LocalSandbox.run`` with no warm pool (every run starts its own sandbox, which is destroyed after it):
  ``fresh_vs_warm`` (p50, fresh / local) is what the warm pool saves;
- cold python: ``/usr/bin/python3 -c 'print(1)'`` as a plain asyncio subprocess: ``local_vs_cold_python`` (was
  ``local_vs_bare``) compares a pre-forked interpreter with a cold interpreter start, *not* isolation overhead;
- docker: ``DockerSandbox.run`` (warm pool of locked-down containers), if a Docker engine answers;
- plus, for information, one session cell (the ReTool path) on each backend;
- cpp (``--n-cpp``, 0 to skip): compile + run of a small C++ program (``g++ -O2``), p50/p99, in the local sandbox
  against the same two commands as plain subprocesses (``cpp_vs_bare``); and 10 stdin tests of one program as
  one request with ``cases`` (compile once) against 10 requests (compile per test): ``cases_vs_per_test`` is the
  per-test wall time over the cases wall time.
- fleet (``--n-fleet``, 0 to skip): throughput at concurrency ``--fleet-concurrency`` (32) of ``print(1)`` through
  two ``agentrl sandbox serve --backend local`` processes (``--server-concurrency`` slots each) in a
  ``SandboxFleet`` against one of them through a ``RemoteSandbox``: ``fleet_vs_single`` is the ratio of
  requests/s. Both servers run on this machine, so they share its cores with each other and with this client:
  what a second server adds here is a second event loop and more slots, not more CPU; one server with twice the
  slots (``single_2x_slots_vs_single``) tells the two apart.

Every ratio is ``benchmarks/_common.py``'s: an untimed warm-up of each side, then ``--rounds`` (7) rounds
alternating the order, the median of the per-round ratios and its range (``…_range=lo-hi``). Latency is measured
per request from the caller's side (``--n`` requests per side and round at concurrency 1); absolute p50/p99 pool
every round's requests; throughput is requests completed per second of wall time with ``c`` requests in flight.
Targets: local p50 <= 1.5 x floor p50, docker warm p50 <= 150 ms. ``--quick``: 3 rounds, few requests, no
Docker (a check that it runs, not a figure to quote).
Usage: python benchmarks/sandbox_bench.py [--rounds 7] [--n 30] [--n-cpp 3] [--n-fleet 200] [--skip-docker]
[--quick]
Last line: local_vs_floor=… local_vs_floor_range=… fresh_vs_warm=… local_vs_cold_python=… local_p50_ms=…
floor_p50_ms=… fresh_p50_ms=… docker_p50_ms=… throughput_c8_per_s=… cpp_compile_run_p50_ms=…
cpp_compile_run_p99_ms=… cpp_vs_bare=… cases_vs_per_test=… single_c32_per_s=… fleet_c32_per_s=…
single_2x_slots_c32_per_s=… fleet_vs_single=… single_2x_slots_vs_single=… rounds=… then the footer (cpu= cores=
… commit= load1_start= load1_end=).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from _common import MIN_ROUNDS, Comparison, ainterleaved, environment, last_line  # this folder's

from agentrl.errors import SandboxError
from agentrl.sandbox import docker_available
from agentrl.sandbox._core import START_ERRORS, WarmSandbox
from agentrl.sandbox._wire import SANDBOX_ENV, Conn, launcher_source, ping
from agentrl.sandbox.base import Limits, RequestStatus, RunRequest, Sandbox
from agentrl.sandbox.local import NOBODY, LocalSandbox

PROGRAM = "print(1)"
CPP = ('#include <iostream>\nint main() { long a, b; std::cin >> a >> b; std::cout << a + b << std::endl; }')


# ----------------------------------------------------------------------------------------------- the floor


class _FloorConn(Conn):
    """A run message rewritten for a launcher on the host: its own working dir, the only place emptied after the
    run, and no leftover check (on the host, /proc lists every process of the machine, never "clean")."""

    def __init__(self, proc: asyncio.subprocess.Process, workdir: str) -> None:
        assert proc.stdout is not None and proc.stdin is not None
        super().__init__(proc.stdout, proc.stdin)
        self.workdir = workdir

    async def send(self, obj: dict[str, Any]) -> None:
        if obj.get("op") == "run":
            obj = {**obj, "workdir": self.workdir, "wipe": [self.workdir], "check_clean": False}
        await super().send(obj)


class _FloorBox:
    def __init__(self, proc: asyncio.subprocess.Process, workdir: str) -> None:
        self.proc, self.workdir = proc, workdir
        self.conn = _FloorConn(proc, workdir)
        self.uses = 0

    def alive(self) -> bool:
        return self.proc.returncode is None

    def oom_kills(self) -> int:
        return 0

    async def destroy(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), 5.0)
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


class BareLauncher(WarmSandbox[_FloorBox]):
    """The local sandbox's floor: the same launcher, warm pool, wire protocol and rlimits (an address-space cap in
    place of the memory cgroup), run as nobody (``setpriv``, as the local sandbox does) in a PID namespace of its
    own (``unshare --pid --fork --kill-child``) and nothing else: no bubblewrap (no user, mount, network, IPC or
    UTS namespace, no read-only root, no tmpfs), no cgroup, no leftover check. The PID namespace stays because
    the launcher's clean-up after every run is ``kill(-1)``: on the host it would reach every process of the
    user, and as kill(-1) answers success when it may signal none of them, the launcher would retry it for its
    full second. Benchmark-only: it isolates nothing. Needs root (setpriv, a PID namespace)."""

    kind = "floor"

    def __init__(self, *, max_concurrency: int = 8, python: str = "/usr/bin/python3") -> None:
        super().__init__(limits=Limits(), max_concurrency=max_concurrency, pool_size=None, max_sessions=1,
                         session_idle_s=60.0, session_wait_s=1.0, start_timeout_s=10.0, grace_s=2.0, max_uses=200)
        self.python = python

    async def _setup(self) -> None:
        if os.geteuid() != 0 or not all(os.access(f"/usr/bin/{t}", os.X_OK) for t in ("setpriv", "unshare")):
            raise SandboxError("the floor needs root and util-linux (setpriv, unshare): the local_vs_floor figures "
                               "are left out")

    async def _spawn(self, limits: Limits) -> _FloorBox:
        workdir = tempfile.mkdtemp(prefix="agentrl-floor-")
        os.chown(workdir, NOBODY, NOBODY)
        proc = await asyncio.create_subprocess_exec(
            "/usr/bin/unshare", "--pid", "--fork", "--kill-child", "--",
            "/usr/bin/setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--",
            self.python, "-I", "-c", launcher_source(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, cwd=workdir, env={**SANDBOX_ENV, "HOME": workdir, "TMPDIR": workdir})
        box = _FloorBox(proc, workdir)
        try:
            async with asyncio.timeout(self._start_timeout_s):
                await ping(box.conn)
        except START_ERRORS as exc:
            await box.destroy()
            raise SandboxError(f"the floor's launcher did not start: {exc!r}") from None
        return box

    def _launch_options(self) -> dict[str, Any]:
        return {"cgroup_memory": False, "nproc": None}


class FreshLocal(LocalSandbox):
    """``LocalSandbox`` without a warm pool: a pool of size 0 starts a sandbox in ``get`` and destroys it in
    ``put``, so every run pays bubblewrap's and the launcher's start (``pool_size`` cannot say 0: None means
    ``max_concurrency``; benchmark-only, so the private field is set here)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._pool_size = 0


# ----------------------------------------------------------------------------------------------- one request


async def cold_python_once() -> None:
    proc = await asyncio.create_subprocess_exec("/usr/bin/python3", "-c", PROGRAM,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0 and out == b"1\n"


def sandbox_once(sb: Sandbox) -> Callable[[], Awaitable[None]]:
    request = RunRequest(code=PROGRAM, limits=Limits(time_s=10))

    async def once() -> None:
        r = await sb.run(request)
        assert r.status is RequestStatus.SUCCESS and r.stdout == "1\n", r

    return once


async def bare_cpp_once() -> None:
    """g++ then the binary, as plain subprocesses in a fresh directory (no isolation at all)."""
    with tempfile.TemporaryDirectory() as d:
        Path(d, "main.cpp").write_text(CPP)
        cc = await asyncio.create_subprocess_exec("g++", "-std=c++17", "-O2", "-o", "main", "main.cpp", cwd=d)
        assert await asyncio.wait_for(cc.wait(), 120) == 0
        run = await asyncio.create_subprocess_exec("./main", cwd=d, stdin=asyncio.subprocess.PIPE,
                                                   stdout=asyncio.subprocess.PIPE)
        out, _ = await asyncio.wait_for(run.communicate(b"40 2\n"), 30)
        assert out == b"42\n"


def sandbox_cpp_once(sb: Sandbox) -> Callable[[], Awaitable[None]]:
    request = RunRequest(code=CPP, language="cpp", stdin="40 2\n", limits=Limits(time_s=10, compile_time_s=60))

    async def once() -> None:
        r = await sb.run(request)
        assert r.status is RequestStatus.SUCCESS and r.stdout == "42\n", r

    return once


# ----------------------------------------------------------------------------------------------- measuring


def percentile(ms: list[float], q: float) -> float:
    s = sorted(ms)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def batch(once: Callable[[], Awaitable[None]], n: int) -> Callable[[], Awaitable[list[float]]]:
    """``n`` requests one after the other: their latencies in ms."""
    async def run() -> list[float]:
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            await once()
            lat.append((time.perf_counter() - t) * 1e3)
        return lat

    return run


async def latency_ratio(rounds: int, n: int, base: Callable[[], Awaitable[None]],
                        ours: Callable[[], Awaitable[None]]) -> Comparison[list[float]]:
    """Rounds of ``n`` requests of each side at concurrency 1, alternating, after 3 untimed requests of each. The
    "rate" handed to ``ainterleaved`` is the p50 itself, so each round's ratio is ours' p50 over base's (a latency
    ratio: lower is better)."""
    async def warmup() -> None:
        for _ in range(3):
            await base()
            await ours()

    return await ainterleaved(rounds, batch(base, n), batch(ours, n), rate=statistics.median, warmup=warmup)


def pooled(*sides: list[list[float]]) -> list[float]:
    return [x for side in sides for lat in side for x in lat]


async def measure(once: Callable[[], Awaitable[None]], n: int, concurrency: int) -> tuple[float, float, float]:
    """(p50 ms, p99 ms, requests/s) over ``n`` requests with ``concurrency`` in flight, after 10 untimed ones."""
    for _ in range(min(10, n)):
        await once()
    lat: list[float] = []
    queue = iter(range(n))

    async def worker() -> None:
        for _ in queue:
            t = time.perf_counter()
            await once()
            lat.append((time.perf_counter() - t) * 1e3)

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(concurrency):
            tg.create_task(worker())
    wall = time.perf_counter() - t0
    return statistics.median(lat), percentile(lat, 0.99), n / wall


async def session_cell_ms(sb: Sandbox, n: int) -> float:
    s = await sb.session("python", Limits(time_s=10))
    try:
        await s.run("x = 0")
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            r = await s.run("x += 1\nprint(x)")
            lat.append(time.perf_counter() - t)
            assert r.status is RequestStatus.SUCCESS, r
        return statistics.median(lat) * 1e3
    finally:
        await s.aclose()


async def cases_vs_per_test(sb: Sandbox, rounds: int, tests: int = 10) -> Comparison[float]:
    """Wall seconds of ``tests`` stdin tests as one request with cases (base) and as one request per test (ours):
    each round's ratio is per-test over cases."""
    limits = Limits(time_s=10, compile_time_s=60)
    stdins = [f"{i} {i}\n" for i in range(tests)]

    async def cases() -> float:
        t = time.perf_counter()
        r = await sb.run(RunRequest(code=CPP, language="cpp", cases=tuple(stdins), limits=limits))
        assert [c.stdout for c in r.cases] == [f"{2 * i}\n" for i in range(tests)], r
        return time.perf_counter() - t

    async def per_test() -> float:
        t = time.perf_counter()
        for stdin in stdins:
            one = await sb.run(RunRequest(code=CPP, language="cpp", stdin=stdin, limits=limits))
            assert one.status is RequestStatus.SUCCESS, one
        return time.perf_counter() - t

    return await ainterleaved(rounds, cases, per_test, rate=float, warmup=sandbox_cpp_once(sb))


@contextlib.asynccontextmanager
async def served(slots: int, log_dir: str) -> AsyncIterator[str]:
    """An ``agentrl sandbox serve --backend local`` process on a free port (its URL once it answers), killed after."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    with open(Path(log_dir, f"serve-{port}.log"), "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "sandbox", "serve", "--backend", "local",
                                 "--port", str(port), "--max-concurrency", str(slots), "--max-queue", "256"],
                                cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        from agentrl.sandbox.remote import RemoteSandbox

        url = f"http://127.0.0.1:{port}"
        async with RemoteSandbox(url) as probe_client, asyncio.timeout(120):
            while not await probe_client.ping():
                assert proc.poll() is None, Path(log_dir, f"serve-{port}.log").read_text()[-2000:]
                await asyncio.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


async def fleet_vs_single(rounds: int, n: int, concurrency: int, slots: int) -> dict[str, Comparison[float]]:
    """Requests/s of ``print(1)`` at ``concurrency`` through one server (base) against a fleet of two and against
    one server with twice the slots, each pair alternating."""
    from agentrl.sandbox.fleet import SandboxFleet
    from agentrl.sandbox.remote import RemoteSandbox

    with tempfile.TemporaryDirectory() as logs:
        async with served(slots, logs) as a, served(slots, logs) as b, served(2 * slots, logs) as wide:
            def through(make: Callable[[], Any]) -> Callable[[], Awaitable[float]]:
                async def rps() -> float:
                    async with make() as sb:  # measure() warms each client with 10 requests
                        return (await measure(sandbox_once(sb), n, concurrency))[2]
                return rps

            single = through(lambda: RemoteSandbox(a, max_connections=concurrency))
            fleet = through(lambda: SandboxFleet([a, b], max_connections=concurrency))
            wider = through(lambda: RemoteSandbox(wide, max_connections=concurrency))
            nothing = lambda: asyncio.sleep(0)  # noqa: E731
            return {"fleet": await ainterleaved(rounds, single, fleet, warmup=nothing),
                    "single_2x_slots": await ainterleaved(rounds, single, wider, warmup=nothing)}


def show(name: str, cmp: Comparison[Any]) -> str:
    lo, hi = cmp.range
    return f"{name}={cmp.median:.3g} (rounds {lo:.3g}-{hi:.3g}{', parity' if cmp.parity else ''})"


async def main(args: argparse.Namespace) -> None:
    env = environment(packages=("aiohttp", "fastapi", "uvicorn"))
    rounds, n, nan = args.rounds, args.n, float("nan")
    figures: dict[str, Any] = {}
    async with contextlib.AsyncExitStack() as stack:
        local = await stack.enter_async_context(LocalSandbox(max_concurrency=8))
        fresh = await stack.enter_async_context(FreshLocal(max_concurrency=1))
        try:
            floor = await stack.enter_async_context(BareLauncher(max_concurrency=8))
        except SandboxError as exc:  # not root: the floor is left out, the rest measured
            print(f"floor: {exc}")
            floor = None
        iso = await latency_ratio(rounds, n, sandbox_once(floor or local), sandbox_once(local))
        pool = await latency_ratio(rounds, n, sandbox_once(local), sandbox_once(fresh))
        cold = await latency_ratio(rounds, n, cold_python_once, sandbox_once(local))
        local_lat = pooled(iso.ours, pool.base, cold.ours)
        floor_c8 = await measure(sandbox_once(floor), n * rounds, 8) if floor else (nan, nan, nan)
        local_c8 = await measure(sandbox_once(local), n * rounds, 8)
        cell_ms = {"local": await session_cell_ms(local, 50)}
        print(show("local_vs_floor", iso), show("fresh_vs_warm", pool), show("local_vs_cold_python", cold))
        print(f"p50/p99 ms at concurrency 1: floor {statistics.median(pooled(iso.base)):.2f}/"
              f"{percentile(pooled(iso.base), 0.99):.2f}, local {statistics.median(local_lat):.2f}/"
              f"{percentile(local_lat, 0.99):.2f}, fresh {statistics.median(pooled(pool.ours)):.2f}/"
              f"{percentile(pooled(pool.ours), 0.99):.2f}, cold python {statistics.median(pooled(cold.base)):.2f}; "
              f"concurrency 8: floor {floor_c8[2]:.1f} req/s, local {local_c8[2]:.1f} req/s")
        figures.update({**iso.fields("local_vs_floor"), **pool.fields("fresh_vs_warm"),
                        **cold.fields("local_vs_cold_python"),
                        "local_p50_ms": statistics.median(local_lat),
                        "floor_p50_ms": statistics.median(pooled(iso.base)),
                        "fresh_p50_ms": statistics.median(pooled(pool.ours)),
                        "cold_python_p50_ms": statistics.median(pooled(cold.base)),
                        "throughput_c8_per_s": local_c8[2], "floor_throughput_c8_per_s": floor_c8[2]})
        if floor is None:  # what ran was local against itself
            figures.update({"local_vs_floor": nan, "local_vs_floor_range": (nan, nan), "floor_p50_ms": nan})
        cpp_lat: list[float] = []
        if args.n_cpp > 0 and shutil.which("g++", path="/usr/bin:/bin"):
            cpp = await latency_ratio(rounds, args.n_cpp, bare_cpp_once, sandbox_cpp_once(local))
            cases = await cases_vs_per_test(local, rounds)
            cpp_lat = pooled(cpp.ours)
            print(show("cpp_vs_bare", cpp), show("cases_vs_per_test", cases))
            figures.update({k: v for k, v in {**cpp.fields("cpp_vs_bare"), **cases.fields("cases_vs_per_test")}.items()
                            if k != "rounds"})
        figures["cpp_compile_run_p50_ms"] = statistics.median(cpp_lat) if cpp_lat else nan
        figures["cpp_compile_run_p99_ms"] = percentile(cpp_lat, 0.99) if cpp_lat else nan
    c = args.fleet_concurrency
    if args.n_fleet > 0:
        fleet = await fleet_vs_single(rounds, args.n_fleet, c, args.server_concurrency)
        single = statistics.median(pooled([fleet["fleet"].base, fleet["single_2x_slots"].base]))
        print(f"fleet at concurrency {c}, {args.server_concurrency} slots a server: "
              f"{show('fleet_vs_single', fleet['fleet'])} {show('single_2x_slots_vs_single', fleet['single_2x_slots'])}")
        figures.update({f"single_c{c}_per_s": single,
                        f"fleet_c{c}_per_s": statistics.median(fleet["fleet"].ours),
                        f"single_2x_slots_c{c}_per_s": statistics.median(fleet["single_2x_slots"].ours),
                        **{k: v for k, v in fleet["fleet"].fields("fleet_vs_single").items() if k != "rounds"},
                        **{k: v for k, v in fleet["single_2x_slots"].fields("single_2x_slots_vs_single").items()
                           if k != "rounds"}})
    else:
        figures.update({f"single_c{c}_per_s": nan, f"fleet_c{c}_per_s": nan, "fleet_vs_single": nan})

    why_no_docker = "skipped" if args.skip_docker else docker_available()
    figures["docker_p50_ms"] = nan
    if why_no_docker is None:
        from agentrl.sandbox.docker import DockerSandbox

        async with DockerSandbox(max_concurrency=8) as docker:
            d1, d8 = await measure(sandbox_once(docker), n * rounds, 1), await measure(sandbox_once(docker), n * rounds, 8)
            cell_ms["docker"] = await session_cell_ms(docker, 50)
        print(f"docker: p50 {d1[0]:.2f} ms, p99 {d1[1]:.2f} ms; concurrency 8: {d8[2]:.1f} req/s")
        figures["docker_p50_ms"] = d1[0]
    else:
        print(f"docker: {why_no_docker}")
    for name, ms in cell_ms.items():
        print(f"{name} session cell p50: {ms:.2f} ms")
    if rounds < MIN_ROUNDS:
        print(f"{rounds} rounds (< {MIN_ROUNDS}): a check that it runs, not a figure to quote")
    figures["rounds"] = rounds
    print(last_line(figures, env))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS, help="alternating rounds of every comparison")
    parser.add_argument("--n", type=int, default=30, help="requests per side and round (concurrency 1)")
    parser.add_argument("--n-cpp", type=int, default=3, help="compile+run requests per side and round (0: skip)")
    parser.add_argument("--n-fleet", type=int, default=200, help="requests per side and round of the fleet (0: skip)")
    parser.add_argument("--fleet-concurrency", type=int, default=32, help="requests in flight (fleet measurement)")
    parser.add_argument("--server-concurrency", type=int, default=8, help="slots of each sandbox server")
    parser.add_argument("--skip-docker", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="3 rounds, --n 8, --n-cpp 1, --n-fleet 48, no Docker: a check that it runs")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.n, args.n_cpp, args.n_fleet, args.skip_docker = 3, 8, 1, 48, True
    asyncio.run(main(args))
