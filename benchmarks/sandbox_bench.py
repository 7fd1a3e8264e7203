"""Sandbox latency and throughput for a trivial program (``print(1)``), at concurrency 1 and 8:

- bare:   ``/usr/bin/python3 -c 'print(1)'`` as a plain asyncio subprocess (no isolation at all);
- local:  ``LocalSandbox.run`` (bubblewrap + cgroups + rlimits, warm pool);
- docker: ``DockerSandbox.run`` (warm pool of locked-down containers), if a Docker engine answers;
- plus, for information, one session cell (the ReTool path) on each backend.

Latency is measured per request from the caller's side; throughput is requests completed per second of wall
time with ``c`` requests in flight. Targets: local p50 <= 1.5 x bare p50, docker warm p50 <= 150 ms.
Usage: python benchmarks/sandbox_bench.py [--n 200] [--skip-docker]
Last line: local_vs_bare=... docker_p50_ms=... local_p50_ms=... throughput_c8_per_s=...
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time
from collections.abc import Awaitable, Callable

from agentrl.sandbox import docker_available
from agentrl.sandbox.base import Limits, RequestStatus, RunRequest, Sandbox

PROGRAM = "print(1)"


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


async def main(n: int, skip_docker: bool) -> None:
    from agentrl.sandbox.local import LocalSandbox

    rows: dict[tuple[str, int], tuple[float, float, float]] = {}
    cells: dict[str, float] = {}
    for c in (1, 8):
        rows[("bare", c)] = await measure(bare_once, n, c)
    async with LocalSandbox(max_concurrency=8) as local:
        for c in (1, 8):
            rows[("local", c)] = await measure(sandbox_once(local), n, c)
        cells["local"] = await session_cell_ms(local, 50)
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
    for name, ms in cells.items():
        print(f"{name} session cell p50: {ms:.2f} ms")
    if why_no_docker is not None:
        print(f"docker: {why_no_docker}")
    local_p50, bare_p50 = rows[("local", 1)][0], rows[("bare", 1)][0]
    docker_p50 = rows[("docker", 1)][0] if ("docker", 1) in rows else float("nan")
    print(f"local_vs_bare={local_p50 / bare_p50:.2f} docker_p50_ms={docker_p50:.1f} local_p50_ms={local_p50:.1f} "
          f"throughput_c8_per_s={rows[('local', 8)][2]:.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200, help="requests per measurement")
    parser.add_argument("--skip-docker", action="store_true")
    args = parser.parse_args()
    asyncio.run(main(args.n, args.skip_docker))
