"""Evaluation tasks end to end: a real uvicorn server, a real Redis, the real SGLang server of the session (tiny
model, reached by URL), the real local sandbox. Queued → succeeded with metrics; paging; cancel; an API restart
(clean, and a killed process) in the middle of a task loses nothing and stores no sample twice."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_support import body

from agentrl.api import ApiSettings
from agentrl.client import AsyncEvalClient
from agentrl.engine.client import SGLangClient

pytestmark = [pytest.mark.sglang, pytest.mark.redis]


async def wait_until(client: AsyncEvalClient, eval_id: str, pred, timeout_s: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        state = await client.get(eval_id)
        if pred(state):
            return state
        assert time.monotonic() < deadline, f"timed out waiting; last state {state}"
        await asyncio.sleep(0.1)


async def all_records(client: AsyncEvalClient, eval_id: str) -> list[dict[str, Any]]:
    return [r async for r in client.iter_results(eval_id, page_size=3)]


def long_body(url: str, items: int = 4) -> dict[str, Any]:
    """A task that takes a few seconds: 2 samples per item, one episode at a time."""
    return body(url, dataset={"name": "arithmetic:heldout", "n": items, "seed": 7}, max_concurrency=1,
                sampling={"temperature": 1.0, "max_new_tokens": 16, "seed": 3})


def assert_complete(records: list[dict[str, Any]], total: int) -> None:
    keys = [(r["item_index"], r["sample_index"]) for r in records]
    assert len(keys) == total == len(set(keys)), sorted(keys)  # every sample exactly once


@contextlib.asynccontextmanager
async def served_as(url: str, version: int) -> AsyncIterator[None]:
    """The shared SGLang server reports ``version`` for a while (other tests load weights into it: a test that
    checks versions sets its own, and puts the previous one back)."""
    async with SGLangClient(url) as engine:
        before = await engine.weight_version()
        await engine.set_weight_version(version)
        try:
            yield
        finally:
            await engine.set_weight_version(before)


async def test_a_task_goes_from_queued_to_succeeded_with_metrics(settings: ApiSettings, start_api,
                                                                 sglang_url: str) -> None:
    server = await start_api(settings)
    async with AsyncEvalClient(server.url) as client, served_as(sglang_url, 41):
        eval_id = await client.submit(body(sglang_url))
        seen = set()
        state = await client.wait(eval_id, poll_s=0.05, timeout_s=120,
                                  on_progress=lambda s: seen.add(s["status"]))
        assert state["status"] == "succeeded", state
        assert seen <= {"queued", "running", "succeeded"} and "succeeded" in seen
        assert state["progress"] == {"done": 4, "total": 4, "errors": 0, "fraction": 1.0}
        m = state["metrics"]
        assert m["num_samples"] == 4 and m["num_items"] == 2 and m["num_errors"] == 0
        for key in ("mean_reward", "pass@1", "pass@2", "mean_turns", "mean_tool_calls", "tool_error_rate",
                    "mean_model_tokens", "total_tokens"):
            assert key in m
        assert 0.0 <= m["pass@1"] <= m["pass@2"] <= 1.0 and m["mean_turns"] >= 1
        assert 0 < m["mean_model_tokens"] <= 2 * 24
        assert state["started_at"] >= state["created_at"] and state["finished_at"] >= state["started_at"]

        page = await client.results(eval_id, limit=3)
        assert (page["total"], len(page["records"]), page["next_offset"]) == (4, 3, 3)
        last = await client.results(eval_id, offset=3, limit=3, trajectories=False)
        assert len(last["records"]) == 1 and last["next_offset"] is None and last["records"][0]["trajectory"] is None
        records = await all_records(client, eval_id)
        assert_complete(records, 4)
        r = records[0]
        traj = r["trajectory"]
        assert r["status"] == "ok" and traj["prompt_len"] == r["prompt_tokens"] > 0
        assert len(traj["token_ids"]) == len(traj["loss_mask"]) == r["prompt_tokens"] + r["response_tokens"]
        assert sum(traj["loss_mask"]) == r["model_tokens"] and traj["env"] == "retool"
        assert all(v == 41 for v, m in zip(traj["weight_versions"], traj["loss_mask"]) if m)  # from SGLang

        with pytest.raises(Exception) as info:
            await client.cancel(eval_id)
        assert getattr(info.value, "status", None) == 409


async def test_cancel_a_running_task(settings: ApiSettings, start_api, sglang_url: str) -> None:
    server = await start_api(settings)
    async with AsyncEvalClient(server.url) as client:
        eval_id = await client.submit(long_body(sglang_url, items=8))
        await wait_until(client, eval_id, lambda s: s["progress"]["done"] >= 1)
        state = await client.cancel(eval_id)
        assert state["status"] == "cancelled"
        await wait_until(client, eval_id, lambda s: not server.workers.running, timeout_s=30)
        final = await client.get(eval_id)
        done = final["progress"]["done"]
        assert final["status"] == "cancelled" and 1 <= done < 16
        assert final["metrics"]["num_samples"] + final["metrics"]["num_errors"] == done  # partial metrics
        await asyncio.sleep(1.0)
        assert (await client.get(eval_id))["progress"]["done"] == done  # nothing runs after the cancel
        assert_complete(await all_records(client, eval_id), done)


async def test_a_clean_api_restart_mid_task_resumes_it(settings: ApiSettings, start_api, sglang_url: str) -> None:
    first = await start_api(settings)
    async with AsyncEvalClient(first.url) as client:
        eval_id = await client.submit(long_body(sglang_url))
        await wait_until(client, eval_id, lambda s: s["progress"]["done"] >= 2)
    await first.stop()  # what SIGTERM does: the running task goes back to the queue
    second = await start_api(settings, port=first.port)  # same URL
    async with AsyncEvalClient(second.url) as client:
        mid = await client.get(eval_id)
        assert mid["progress"]["done"] >= 2
        state = await client.wait(eval_id, poll_s=0.1, timeout_s=120)
        assert state["status"] == "succeeded" and state["attempts"] == 1  # a clean hand-back is not an attempt
        assert state["progress"]["done"] == 8 and state["metrics"]["num_samples"] == 8
        assert_complete(await all_records(client, eval_id), 8)


def serve_process(settings: ApiSettings, port: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "agentrl.cli", "serve", "--port", str(port), "--redis-url",
           str(settings.redis_url), "--namespace", settings.namespace, "--lease-s", str(settings.lease_s),
           "--max-tasks", "1", "--data-dir", str(settings.data_dir), "--log-level", "warning"]
    return subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)


async def test_a_killed_api_loses_nothing(settings: ApiSettings, start_api, sglang_url: str,
                                         tmp_path: Path) -> None:
    from agentrl.engine.server import free_port

    port = free_port()
    proc = serve_process(settings, port, tmp_path / "serve.log")
    try:
        async with AsyncEvalClient(f"http://127.0.0.1:{port}", retries=40) as client:
            await client.health()  # retried until the process listens
            eval_id = await client.submit(long_body(sglang_url))
            before = await wait_until(client, eval_id, lambda s: s["progress"]["done"] >= 2)
            stored = {(r["item_index"], r["sample_index"]): r["response"] for r in await all_records(client, eval_id)}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # no shutdown: its lease must expire
        proc.wait(10)
    assert before["status"] == "running"
    second = await start_api(settings)
    async with AsyncEvalClient(second.url) as client:
        state = await client.wait(eval_id, poll_s=0.1, timeout_s=120)
        assert state["status"] == "succeeded" and state["attempts"] == 2, (state, (tmp_path / "serve.log").read_text())
        records = await all_records(client, eval_id)
    assert_complete(records, 8)
    after = {(r["item_index"], r["sample_index"]): r["response"] for r in records}
    assert all(after[k] == v for k, v in stored.items())  # the records stored before the crash are kept as they were


class CountingSemaphore(asyncio.Semaphore):
    """A semaphore that remembers the most holders it had at once."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.holders = self.most = 0

    async def acquire(self) -> bool:
        await super().acquire()
        self.holders += 1
        self.most = max(self.most, self.holders)
        return True

    def release(self) -> None:
        self.holders -= 1
        super().release()


async def test_concurrent_tasks_share_the_global_episode_limit(settings: ApiSettings, start_api,
                                                               sglang_url: str) -> None:
    server = await start_api(settings.model_copy(update={"max_tasks": 3}))
    limiter = server.app.state.agentrl.services.limiter = CountingSemaphore(2)  # the service's max_episodes
    async with AsyncEvalClient(server.url) as client:
        ids = [await client.submit(body(sglang_url, max_concurrency=4)) for _ in range(3)]
        together = 0
        while True:
            states = [await client.get(i) for i in ids]
            together = max(together, sum(s["status"] == "running" for s in states))
            if all(s["status"] == "succeeded" for s in states):
                break
            await asyncio.sleep(0.02)
    assert together >= 2  # tasks ran side by side ...
    assert limiter.most == 2  # ... and their episodes together never passed the global limit
    async with httpx.AsyncClient(base_url=server.url) as http:
        status = (await http.get("/v1/status")).json()
    assert status["engines"][0]["engine"] == f"url:{sglang_url}" and status["running"] == []
