"""Sandbox latency and throughput for a trivial program (``print(1)``), at concurrency 1 and 8:

- bare:   ``/usr/bin/python3 -c 'print(1)'`` as a plain asyncio subprocess (no isolation at all);
- local:  ``LocalSandbox.run`` (bubblewrap + cgroups + rlimits, warm pool);
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
  slots (``single_2x_slots``) tells the two apart.

Latency is measured per request from the caller's side; throughput is requests completed per second of wall
time with ``c`` requests in flight. Targets: local p50 <= 1.5 x bare p50, docker warm p50 <= 150 ms.
Usage: python benchmarks/sandbox_bench.py [--n 200] [--n-cpp 20] [--n-fleet 400] [--skip-docker]
Last line: local_vs_bare=... docker_p50_ms=... local_p50_ms=... throughput_c8_per_s=... cpp_compile_run_p50_ms=...
cpp_compile_run_p99_ms=... cpp_vs_bare=... cases_vs_per_test=... single_c32_per_s=... fleet_c32_per_s=...
single_2x_slots_c32_per_s=... fleet_vs_single=...
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

from agentrl.sandbox import docker_available
from agentrl.sandbox.base import Limits, RequestStatus, RunRequest, Sandbox

PROGRAM = "print(1)"
CPP = ('#include <iostream>\nint main() { long a, b; std::cin >> a >> b; std::cout << a + b << std::endl; }')


async def bare_once() -> None:
    proc = await asyncio.create_subprocess_exec("/usr/bin/python3", "-c", PROGRAM,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    assert proc.returncode == 0 and out == b"1\n"


def sandbox_once(sb: Sandbox) -> Callable[[], Awaitable[None]]:
    request = RunRequest(code=PROGRAM, limits=Limits(time_s=10))

    async def once() -> None:
        r = await sb.run(request)
        assert r.status is RequestStatus.SUCCESS and r.stdout == "1\n", r

    return once


async def measure(once: Callable[[], Awaitable[None]], n: int, concurrency: int) -> tuple[float, float, float]:
    """(p50 ms, p99 ms, requests/s) over ``n`` requests with ``concurrency`` in flight."""
    for _ in range(min(10, n)):
        await once()  # warm-up
    lat: list[float] = []
    queue = iter(range(n))

    async def worker() -> None:
        for _ in queue:
            t = time.perf_counter()
            await once()
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(concurrency):
            tg.create_task(worker())
    wall = time.perf_counter() - t0
    lat.sort()
    p99 = lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)]
    return statistics.median(lat) * 1e3, p99 * 1e3, n / wall


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


async def bare_cpp_once() -> None:
    """g++ then the binary, as plain subprocesses in a fresh directory (no isolation at all)."""
    with tempfile.TemporaryDirectory() as d:
        Path(d, "main.cpp").write_text(CPP)
        cc = await asyncio.create_subprocess_exec("g++", "-std=c++17", "-O2", "-o", "main", "main.cpp", cwd=d)
        assert await cc.wait() == 0
        run = await asyncio.create_subprocess_exec("./main", cwd=d, stdin=asyncio.subprocess.PIPE,
                                                   stdout=asyncio.subprocess.PIPE)
        out, _ = await run.communicate(b"40 2\n")
        assert out == b"42\n"


def sandbox_cpp_once(sb: Sandbox) -> Callable[[], Awaitable[None]]:
    request = RunRequest(code=CPP, language="cpp", stdin="40 2\n", limits=Limits(time_s=10, compile_time_s=60))

    async def once() -> None:
        r = await sb.run(request)
        assert r.status is RequestStatus.SUCCESS and r.stdout == "42\n", r

    return once


async def cases_vs_per_test(sb: Sandbox, tests: int = 10, rounds: int = 3) -> float:
    """Wall time of ``tests`` stdin tests as one request per test over as one request with cases (median)."""
    limits = Limits(time_s=10, compile_time_s=60)
    stdins = [f"{i} {i}\n" for i in range(tests)]
    ratios = []
    for _ in range(rounds):
        t = time.perf_counter()
        r = await sb.run(RunRequest(code=CPP, language="cpp", cases=tuple(stdins), limits=limits))
        cases_s = time.perf_counter() - t
        assert [c.stdout for c in r.cases] == [f"{2 * i}\n" for i in range(tests)], r
        t = time.perf_counter()
        for stdin in stdins:
            one = await sb.run(RunRequest(code=CPP, language="cpp", stdin=stdin, limits=limits))
            assert one.status is RequestStatus.SUCCESS, one
        ratios.append((time.perf_counter() - t) / cases_s)
    return statistics.median(ratios)


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


async def fleet_vs_single(n: int, concurrency: int, slots: int, rounds: int = 3) -> dict[str, float]:
    """Requests/s of ``print(1)`` at ``concurrency`` through one server and through a fleet of two, in alternating
    rounds (the median of each: this host's load drifts)."""
    from agentrl.sandbox.fleet import SandboxFleet
    from agentrl.sandbox.remote import RemoteSandbox

    single_rps, fleet_rps, wide_rps = [], [], []
    with tempfile.TemporaryDirectory() as logs:
        async with served(slots, logs) as a, served(slots, logs) as b, served(2 * slots, logs) as wide:
            for _ in range(rounds):
                async with RemoteSandbox(a, max_connections=concurrency) as single:
                    single_rps.append((await measure(sandbox_once(single), n, concurrency))[2])
                async with SandboxFleet([a, b], max_connections=concurrency) as fleet:
                    fleet_rps.append((await measure(sandbox_once(fleet), n, concurrency))[2])
                    spread = [s.requests for s in fleet.stats()]
                async with RemoteSandbox(wide, max_connections=concurrency) as single:
                    wide_rps.append((await measure(sandbox_once(single), n, concurrency))[2])
    single, both, wider = (statistics.median(x) for x in (single_rps, fleet_rps, wide_rps))
    print(f"fleet: {n} x print(1) at concurrency {concurrency}, median of {rounds} rounds: one server of {slots} slots "
          f"{single:.1f} req/s {[round(x) for x in single_rps]}, two of {slots} {both:.1f} req/s "
          f"{[round(x) for x in fleet_rps]} (requests per server, last round: {spread}), one of {2 * slots} "
          f"{wider:.1f} req/s {[round(x) for x in wide_rps]}")
    return {"single": single, "fleet": both, "single_2x_slots": wider}


async def main(n: int, skip_docker: bool, n_cpp: int = 20, n_fleet: int = 400, fleet_concurrency: int = 32,
               server_concurrency: int = 8) -> None:
    from agentrl.sandbox.local import LocalSandbox

    rows: dict[tuple[str, int], tuple[float, float, float]] = {}
    cells: dict[str, float] = {}
    for c in (1, 8):
        rows[("bare", c)] = await measure(bare_once, n, c)
    async with LocalSandbox(max_concurrency=8) as local:
        for c in (1, 8):
            rows[("local", c)] = await measure(sandbox_once(local), n, c)
        cells["local"] = await session_cell_ms(local, 50)
        cpp: dict[str, float] = {}
        if n_cpp > 0 and shutil.which("g++", path="/usr/bin:/bin"):
            rows[("cpp-bare", 1)] = await measure(bare_cpp_once, n_cpp, 1)
            rows[("cpp", 1)] = await measure(sandbox_cpp_once(local), n_cpp, 1)
            cpp["cases_vs_per_test"] = await cases_vs_per_test(local)
    fleet = await fleet_vs_single(n_fleet, fleet_concurrency, server_concurrency) if n_fleet > 0 else {}
    why_no_docker = "skipped (--skip-docker)" if skip_docker else docker_available()
    if why_no_docker is None:
        from agentrl.sandbox.docker import DockerSandbox

        async with DockerSandbox(max_concurrency=8) as docker:
            for c in (1, 8):
                rows[("docker", c)] = await measure(sandbox_once(docker), n, c)
            cells["docker"] = await session_cell_ms(docker, 50)

    print(f"{'backend':<8} {'conc':>4} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8}")
    for (name, c), (p50, p99, rps) in rows.items():
        print(f"{name:<8} {c:>4} {p50:>8.2f} {p99:>8.2f} {rps:>8.1f}")
    if cpp:
        print(f"cpp: 10 stdin tests, one request with cases vs one request per test: "
              f"per-test takes {cpp['cases_vs_per_test']:.2f}x as long")
    for name, ms in cells.items():
        print(f"{name} session cell p50: {ms:.2f} ms")
    if why_no_docker is not None:
        print(f"docker: {why_no_docker}")
    local_p50, bare_p50 = rows[("local", 1)][0], rows[("bare", 1)][0]
    docker_p50 = rows[("docker", 1)][0] if ("docker", 1) in rows else float("nan")
    nan = (float("nan"),) * 3
    cpp_p50, cpp_p99, _ = rows.get(("cpp", 1), nan)
    cpp_bare = rows.get(("cpp-bare", 1), nan)[0]
    print(f"local_vs_bare={local_p50 / bare_p50:.2f} docker_p50_ms={docker_p50:.1f} local_p50_ms={local_p50:.1f} "
          f"throughput_c8_per_s={rows[('local', 8)][2]:.1f} cpp_compile_run_p50_ms={cpp_p50:.0f} "
          f"cpp_compile_run_p99_ms={cpp_p99:.0f} cpp_vs_bare={cpp_p50 / cpp_bare:.2f} "
          f"cases_vs_per_test={cpp.get('cases_vs_per_test', float('nan')):.2f} "
          f"single_c{fleet_concurrency}_per_s={fleet.get('single', float('nan')):.1f} "
          f"fleet_c{fleet_concurrency}_per_s={fleet.get('fleet', float('nan')):.1f} "
          f"single_2x_slots_c{fleet_concurrency}_per_s={fleet.get('single_2x_slots', float('nan')):.1f} "
          f"fleet_vs_single={fleet.get('fleet', float('nan')) / fleet.get('single', float('nan')):.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200, help="requests per measurement")
    parser.add_argument("--n-cpp", type=int, default=20, help="compile+run requests of the cpp measurement (0: skip)")
    parser.add_argument("--n-fleet", type=int, default=400, help="requests of the fleet measurement (0: skip)")
    parser.add_argument("--fleet-concurrency", type=int, default=32, help="requests in flight (fleet measurement)")
    parser.add_argument("--server-concurrency", type=int, default=8, help="slots of each sandbox server")
    parser.add_argument("--skip-docker", action="store_true")
    args = parser.parse_args()
    asyncio.run(main(args.n, args.skip_docker, args.n_cpp, args.n_fleet, args.fleet_concurrency,
                     args.server_concurrency))
