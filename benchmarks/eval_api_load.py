"""Evaluation API under load: submissions from many clients over a lossy network, then (unless --submit-only)
every task followed to the end.

Set-up (all real, all started here): an embedded Redis, ``agentrl serve`` as its own process, and for a full run
an SGLang server with the ``tiny`` model (or ``--engine-url``). Each task is one inline item, one sample, a few
new tokens, one turn. ``--clients`` clients (each its own ``AsyncEvalClient`` and connection pool) share the
``--n`` submissions; each client's transport loses a ``--drop`` fraction of its POSTs at random, half of them on
the way in (the server never sees the request) and half on the way back (the server made the task, the reply is
lost). The client retries a submission with its one Idempotency-Key, so a lost reply must neither lose the task
nor make a second one. A submission's latency is from its first attempt to the answer that was received,
retries and their back-off included. With ``--kill`` (full runs, default) the API process is SIGKILLed once a
third of the tasks finished and a new one is started on the same Redis: its reaper re-queues the interrupted
tasks after their lease. The kill is proven to have landed while tasks were in flight, twice over:
``running_at_kill`` (tasks of this run in the ``running`` state in the last look before the kill) and
``interrupted`` (finished tasks whose ``attempts`` is 2 or more: claimed by the killed process, run again by its
successor); a run where either is 0 says so, since it did not test recovery.

duplicates = tasks the store holds for this run beyond one per submission (listed by the run's label, cursor-
paged); lost = submissions that got no task (failed after their retries, or answered with an id the store does
not hold), plus, in a full run, tasks that never finish or finish with a record count other than their sample
count; ``failed`` (tasks that finished as failed: an infrastructure error reported, not lost) is printed beside
it. Last line: ``submitted=… duplicates=… lost=… failed=… … running_at_kill=… interrupted=… cpu=… cores=…
commit=…`` (benchmarks/_common.py). Usage: python benchmarks/eval_api_load.py [--n 100] [--clients 16]
[--drop 0.1] [--submit-only] [--engine-url URL] [--no-kill] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from _common import environment, last_line  # this folder's

from agentrl.client import TERMINAL, AsyncEvalClient
from agentrl.engine.server import SGLangServer, SGLangServerConfig, free_port
from agentrl.hardware import engine_dtype
from agentrl.models import resolve_model
from agentrl.queue import EmbeddedRedis


def task_body(i: int, engine_url: str, run: str) -> dict[str, Any]:
    return {"environment": {"name": "retool"},
            "dataset": {"items": [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)}]},
            "model": {"url": engine_url}, "sampling": {"max_new_tokens": 8}, "samples_per_item": 1,
            "pass_k": [1], "max_turns": 1, "keep_trajectories": True, "labels": {"bench": run, "i": str(i)}}


class LossyTransport(httpx.AsyncBaseTransport):
    """Loses a ``drop`` fraction of POSTs: half before the server sees them, half after it answered."""

    def __init__(self, drop: float, rng: random.Random) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.drop, self.rng = drop, rng
        self.attempts = self.lost_requests = self.lost_replies = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST":
            return await self.inner.handle_async_request(request)
        self.attempts += 1
        if self.rng.random() >= self.drop:
            return await self.inner.handle_async_request(request)
        if self.rng.random() < 0.5:
            self.lost_requests += 1
            raise httpx.ConnectError("request lost on the way (benchmark)", request=request)
        response = await self.inner.handle_async_request(request)
        await response.aread()
        await response.aclose()
        self.lost_replies += 1
        raise httpx.ReadError("reply lost on the way back (benchmark)", request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()


class ApiProcess:
    def __init__(self, redis_url: str, data_dir: Path, lease_s: float, max_tasks: int = 4) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log = open(data_dir / f"api-{self.port}.log", "wb")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agentrl.cli", "serve", "--port", str(self.port), "--redis-url", redis_url,
             "--data-dir", str(data_dir), "--lease-s", str(lease_s), "--max-tasks", str(max_tasks), "--max-episodes", "8",
             "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def submit_all(url: str, n: int, clients: int, drop: float, engine_url: str, run: str,
                     seed: int) -> tuple[list[str], list[float], int, dict[str, int]]:
    """n submissions shared by ``clients`` lossy clients; returns (ids answered, latencies ms, failures, counts)."""
    todo = iter(range(n))
    ids: list[str] = []
    lat_ms: list[float] = []
    failed = 0
    transports = [LossyTransport(drop, random.Random(seed * 1000 + c)) for c in range(clients)]

    async def client_loop(transport: LossyTransport) -> None:
        nonlocal failed
        async with AsyncEvalClient(url, retries=8, timeout_s=60, transport=transport) as client:
            for i in todo:  # shared: each index goes to one client
                t0 = time.perf_counter()
                try:
                    ids.append(await client.submit(task_body(i, engine_url, run)))
                    lat_ms.append((time.perf_counter() - t0) * 1000)
                except Exception as exc:  # noqa: BLE001 - counted as lost
                    print(f"submission {i} failed after its retries: {exc}")
                    failed += 1

    await asyncio.gather(*(client_loop(t) for t in transports))
    counts = {"attempts": sum(t.attempts for t in transports),
              "lost_requests": sum(t.lost_requests for t in transports),
              "lost_replies": sum(t.lost_replies for t in transports)}
    return ids, lat_ms, failed, counts


async def stored_ids(url: str, run: str) -> list[str]:
    async with AsyncEvalClient(url, retries=60) as client:
        return [e["id"] async for e in client.iter_evals(page_size=500, labels={"bench": run})]


async def run(n: int, clients: int, drop: float, engine_url: str, redis_url: str, data_dir: Path, kill: bool,
              lease_s: float, submit_only: bool, seed: int, env: dict[str, Any]) -> None:
    api = ApiProcess(redis_url, data_dir, lease_s, max_tasks=0 if submit_only else 4)
    bench = uuid.uuid4().hex[:8]
    killed = running_at_kill = 0
    finished: dict[str, dict[str, Any]] = {}
    try:
        async with AsyncEvalClient(api.url, retries=60, timeout_s=60) as client:
            await client.health()  # waits (with retries) until the process serves
        t_start = time.perf_counter()
        ids, lat_ms, failed, counts = await submit_all(api.url, n, clients, drop, engine_url, bench, seed)
        t_submitted = time.perf_counter() - t_start
        stored = await stored_ids(api.url, bench)
        wanted = set(ids)
        while not submit_only and len(finished) < len(ids) and time.perf_counter() - t_start < 1800:
            running = 0
            async with AsyncEvalClient(api.url, retries=60) as client:  # one cursor walk per round, not n GETs
                async for state in client.iter_evals(page_size=500, labels={"bench": bench}):
                    if state["id"] in wanted and state["status"] in TERMINAL:
                        finished[state["id"]] = state
                    running += state["id"] in wanted and state["status"] == "running"
            if kill and not killed and len(finished) >= len(ids) // 3:
                running_at_kill = running  # as seen just before the kill (< 0.1 s: no sleep in between)
                api.kill()
                killed += 1
                api = ApiProcess(redis_url, data_dir, lease_s)
            await asyncio.sleep(0.5)
        wall = time.perf_counter() - t_start
        complete = 0
        async with AsyncEvalClient(api.url, retries=60) as client:
            for eval_id, state in finished.items():
                page = await client.results(eval_id, limit=10, trajectories=False)
                complete += state["status"] == "succeeded" and page["total"] == state["progress"]["total"]
    finally:
        api.stop()
    duplicates = len(stored) - len(set(stored) & wanted)  # tasks no submission was answered with
    lost = failed + len(wanted - set(stored))
    p50, p99 = statistics.median(lat_ms), pct(lat_ms, 0.99)
    rows: list[tuple[str, Any]] = [
        ("submissions", n), ("clients", clients), ("drop fraction", drop), ("POST attempts", counts["attempts"]),
        ("requests lost on the way in", counts["lost_requests"]), ("replies lost", counts["lost_replies"]),
        ("submitted (answered)", len(ids)), ("tasks stored", len(stored)), ("duplicates", duplicates),
        ("lost", lost), ("submit p50 ms", p50), ("submit p95 ms", pct(lat_ms, 0.95)), ("submit p99 ms", p99),
        ("submit max ms", max(lat_ms)), (f"all {n} submitted in s", t_submitted),
        ("submissions per s", len(ids) / t_submitted)]
    failed_tasks = interrupted = 0
    if not submit_only:
        succeeded = sum(s["status"] == "succeeded" for s in finished.values())
        failed_tasks = sum(s["status"] == "failed" for s in finished.values())
        interrupted = sum(int(s.get("attempts") or 0) >= 2 for s in finished.values())
        lost += len(ids) - complete - sum(s["status"] in ("failed", "cancelled") for s in finished.values())
        rows += [("all finished in s", wall), ("tasks per s (end to end)", len(finished) / wall),
                 ("succeeded", succeeded), ("failed (reported, not lost)", failed_tasks),
                 ("API processes killed mid-run", killed), ("tasks running at the kill", running_at_kill),
                 ("tasks interrupted and re-run", interrupted), ("lost (end to end)", lost)]
    print(f"{'figure':<36}{'value':>12}")
    for name, value in rows:
        print(f"{name:<36}{value:>12.1f}" if isinstance(value, float) else f"{name:<36}{value:>12}")
    if killed and not (running_at_kill and interrupted):
        print("note: the kill did not land while tasks were in flight (running at the kill "
              f"{running_at_kill}, interrupted {interrupted}): this run did not test recovery")
    figures: dict[str, Any] = {"submitted": len(ids), "duplicates": duplicates, "lost": lost,
                               "failed_submissions": failed, "p50_submit_ms": p50, "p99_submit_ms": p99}
    if submit_only:
        figures.update({"submissions_per_s": len(ids) / t_submitted, "clients": clients,
                        "replies_lost": counts["lost_replies"], "requests_lost": counts["lost_requests"]})
    else:
        figures.update({"failed": failed_tasks, "succeeded": succeeded, "p95_submit_ms": pct(lat_ms, 0.95),
                        "tasks_per_s": len(finished) / wall, "killed_servers": killed,
                        "running_at_kill": running_at_kill, "interrupted": interrupted, "clients": clients})
    print(last_line(figures, env))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100, help="submissions")
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients sharing the submissions")
    ap.add_argument("--drop", type=float, default=0.1, help="fraction of POSTs lost (request or reply)")
    ap.add_argument("--submit-only", action="store_true",
                    help="only submit and count (no SGLang; the API queues, max_tasks 0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-url", default=None, help="a running SGLang server (default: start one, tiny model)")
    ap.add_argument("--no-kill", dest="kill", action="store_false", help="do not kill the API mid-run")
    ap.add_argument("--lease-s", type=float, default=3.0)
    ap.add_argument("--quick", action="store_true", help="a check that the script runs: 24 submissions, 4 clients")
    args = ap.parse_args()
    if args.quick:
        args.n, args.clients = 24, 4
    with tempfile.TemporaryDirectory(prefix="agentrl-evalbench-") as tmp, EmbeddedRedis(Path(tmp) / "redis") as redis:
        server = None
        ours = args.engine_url is None and not args.submit_only  # the SGLang server is started here
        server_cfg = SGLangServerConfig(model_path=str(resolve_model("tiny")), max_total_tokens=8192) if ours else None
        env = environment(dtype=engine_dtype(server_cfg.dtype, server_cfg.device) if server_cfg else None,
                          packages=("redis", "httpx", "fastapi", "uvicorn") + (() if args.submit_only else ("sglang",)))
        if server_cfg is not None:
            server = SGLangServer(server_cfg, log_path=Path(tmp) / "sglang.log").start()
        engine_url = args.engine_url or (server.url if server is not None else "http://127.0.0.1:9")
        try:
            asyncio.run(run(args.n, args.clients, args.drop, engine_url, redis.url, Path(tmp), args.kill,
                            args.lease_s, args.submit_only, args.seed, env))
        finally:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    main()
