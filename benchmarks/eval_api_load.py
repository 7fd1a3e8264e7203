"""Evaluation API under load: 100 concurrent submissions of small tasks, then every task followed to the end.

Set-up (all real, all started here): an embedded Redis, an SGLang server with the ``tiny`` model (or
``--engine-url``), and ``agentrl serve`` as its own process. Each task is one inline item, one sample, a few new
tokens, one turn. All submissions are sent at once from one asyncio client; their latencies (202 received) are
the submit figures. With ``--kill`` (default) the API process is SIGKILLed once a third of the tasks finished and
a new one is started on the same Redis: its reaper re-queues the interrupted tasks after their lease.

lost = tasks that were accepted (202) but are unknown afterwards, never finish, or finish with a record count
different from their sample count. Usage: python benchmarks/eval_api_load.py [--n 100] [--engine-url URL] [--no-kill]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentrl.client import TERMINAL, AsyncEvalClient
from agentrl.engine.server import SGLangServer, SGLangServerConfig, free_port
from agentrl.models import resolve_model
from agentrl.queue import EmbeddedRedis


def task_body(i: int, engine_url: str) -> dict[str, Any]:
    return {"environment": {"name": "retool"},
            "dataset": {"items": [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)}]},
            "model": {"url": engine_url}, "sampling": {"max_new_tokens": 8}, "samples_per_item": 1,
            "pass_k": [1], "max_turns": 1, "keep_trajectories": True}


class ApiProcess:
    def __init__(self, redis_url: str, data_dir: Path, lease_s: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log = open(data_dir / f"api-{self.port}.log", "wb")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agentrl.cli", "serve", "--port", str(self.port), "--redis-url", redis_url,
             "--data-dir", str(data_dir), "--lease-s", str(lease_s), "--max-tasks", "4", "--max-episodes", "8",
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


async def run(n: int, engine_url: str, redis_url: str, data_dir: Path, kill: bool, lease_s: float) -> None:
    api = ApiProcess(redis_url, data_dir, lease_s)
    killed = 0
    try:
        async with AsyncEvalClient(api.url, retries=60, timeout_s=60) as client:
            await client.health()  # waits (with retries) until the process serves

            async def submit(i: int) -> tuple[str | None, float]:
                t0 = time.perf_counter()
                try:
                    eval_id = await client.submit(task_body(i, engine_url))
                except Exception as exc:  # noqa: BLE001 - counted as not submitted
                    print(f"submission {i} failed: {exc}")
                    return None, time.perf_counter() - t0
                return eval_id, time.perf_counter() - t0

            t_start = time.perf_counter()
            results = await asyncio.gather(*(submit(i) for i in range(n)))
            t_submitted = time.perf_counter() - t_start
            ids = [i for i, _ in results if i is not None]
            lat_ms = [dt * 1000 for i, dt in results if i is not None]
        finished: dict[str, dict[str, Any]] = {}
        wanted = set(ids)
        deadline = time.monotonic() + 1800
        while len(finished) < len(ids) and time.monotonic() < deadline:
            async with AsyncEvalClient(api.url, retries=60) as client:  # one listing per round, not n GETs
                for state in await client.list_evals(limit=max(500, 2 * n)):
                    if state["id"] in wanted and state["status"] in TERMINAL:
                        finished[state["id"]] = state
            if kill and not killed and len(finished) >= len(ids) // 3:
                api.kill()
                killed += 1
                api = ApiProcess(redis_url, data_dir, lease_s)
            await asyncio.sleep(0.5)
        wall = time.perf_counter() - t_start
        async with AsyncEvalClient(api.url, retries=60) as client:
            complete = 0
            for eval_id, state in finished.items():
                page = await client.results(eval_id, limit=10, trajectories=False)
                complete += state["status"] == "succeeded" and page["total"] == state["progress"]["total"]
    finally:
        api.stop()
    succeeded = sum(s["status"] == "succeeded" for s in finished.values())
    lost = len(ids) - complete - sum(s["status"] in ("failed", "cancelled") for s in finished.values())
    print(f"{'figure':<36}{'value':>12}")
    for name, value in (("tasks submitted (202)", len(ids)), ("submit p50 ms", statistics.median(lat_ms)),
                        ("submit p95 ms", pct(lat_ms, 0.95)), ("submit max ms", max(lat_ms)),
                        ("all 100 submitted in s", t_submitted), ("all finished in s", wall),
                        ("tasks per s (end to end)", len(finished) / wall), ("succeeded", succeeded),
                        ("failed", sum(s["status"] == "failed" for s in finished.values())),
                        ("API processes killed mid-run", killed), ("lost", lost)):
        print(f"{name:<36}{value:>12.1f}" if isinstance(value, float) else f"{name:<36}{value:>12}")
    print(f"submitted={len(ids)} succeeded={succeeded} lost={lost} p50_submit_ms={statistics.median(lat_ms):.1f} "
          f"p95_submit_ms={pct(lat_ms, 0.95):.1f} tasks_per_s={len(finished) / wall:.2f} killed_servers={killed}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--engine-url", default=None, help="a running SGLang server (default: start one, tiny model)")
    ap.add_argument("--no-kill", dest="kill", action="store_false", help="do not kill the API mid-run")
    ap.add_argument("--lease-s", type=float, default=3.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="agentrl-evalbench-") as tmp, EmbeddedRedis(Path(tmp) / "redis") as redis:
        server = None
        if args.engine_url is None:
            server = SGLangServer(SGLangServerConfig(model_path=str(resolve_model("tiny")), max_total_tokens=8192),
                                  log_path=Path(tmp) / "sglang.log").start()
        try:
            asyncio.run(run(args.n, args.engine_url or server.url, redis.url, Path(tmp), args.kill,  # type: ignore[union-attr]
                            args.lease_s))
        finally:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    main()
