"""Streaming progress and webhooks over a real uvicorn API and a real Redis; tasks run for real against a fake
OpenAI-compatible server (real HTTP, the real ReTool environment and local sandbox): the event stream delivers
every progress event, resumes after a reconnect with Last-Event-ID without a gap or a duplicate, ends with the
task; the completion webhook reaches a local receiver with a valid HMAC-SHA256 signature, after a retry."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import socket
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from api_support import body
from fastapi import FastAPI, Request, Response

from agentrl.api import ApiSettings
from agentrl.client import ApiError, AsyncEvalClient, EvalClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from openai_support import FakeOpenAI, Reply, Served  # noqa: E402

SECRET = "a-webhook-secret-for-tests"


def solver(body: dict[str, Any], turn: int) -> Reply:
    question = next(m["content"] for m in body["messages"] if m["role"] == "user")
    a, op, b = question.removeprefix("What is ").rstrip("?").split()
    if turn == 0:
        return Reply(f"<code>print({a} {op} {b})</code>", delay_s=0.1)
    return Reply(f"\\boxed{{{body['messages'][-1]['content'].splitlines()[1]}}}", delay_s=0.1)


def spec(url: str, **kw: Any) -> dict[str, Any]:
    return body(model={"openai_url": url, "openai_model": "fake-model"}, max_concurrency=1, **kw)


async def read_events(http: httpx.AsyncClient, eval_id: str, *, headers: dict[str, str] | None = None,
                      stop_after: int | None = None) -> list[dict[str, Any]]:
    """Parse the server-sent events of a task (``stop_after``: hang up after that many)."""
    events: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    async with http.stream("GET", f"/v1/evals/{eval_id}/events", headers=headers or {}, timeout=60) as resp:
        assert resp.status_code == 200, await resp.aread()
        assert resp.headers["content-type"].startswith("text/event-stream")
        async for line in resp.aiter_lines():
            if line == "":
                if "data" in current:
                    events.append({**current, "data": json.loads(current["data"])})
                    if stop_after is not None and len(events) >= stop_after:
                        return events
                current = {}
            elif not line.startswith(":"):
                key, _, value = line.partition(":")
                current[key] = value.removeprefix(" ")
    return events


async def test_events_deliver_every_progress_event_and_resume_after_a_reconnect(settings: ApiSettings,
                                                                              start_api) -> None:
    server = await start_api(settings)
    async with Served(FakeOpenAI(solver)) as fake, AsyncEvalClient(server.url) as client, \
            httpx.AsyncClient(base_url=server.url) as http:
        eval_id = await client.submit(spec(fake.url))
        first = await read_events(http, eval_id, stop_after=3)  # hang up mid-task
        rest = await read_events(http, eval_id, headers={"Last-Event-ID": first[-1]["id"]})
        state = await client.get(eval_id)
        replay = await read_events(http, eval_id)  # after the end: the whole story, then the stream ends
        tail = await read_events(http, eval_id, headers={"Last-Event-ID": replay[-1]["id"]})
    seen = first + rest
    ids = [e["id"] for e in seen]
    assert len(ids) == len(set(ids)) and ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
    assert seen == replay  # no gap and no duplicate across the reconnect
    progress = [e["data"] for e in seen if e["event"] == "progress"]
    assert [p["done"] for p in progress] == [1, 2, 3, 4] and all(p["total"] == 4 for p in progress)
    statuses = [e["data"]["status"] for e in seen if e["event"] == "status"]
    assert statuses[0] == "queued" and statuses[1] == "running" and statuses[-1] == "succeeded"
    end = seen[-1]
    assert end["event"] == "end" and end["data"]["status"] == "succeeded" == state["status"]
    assert end["data"]["metrics"] == state["metrics"] and end["data"]["progress"]["done"] == 4
    assert end["data"]["metrics"]["intervals"]["accuracy"]["method"] == "bootstrap"  # 2 samples per item
    assert all(set(e["data"]) >= {"num_samples", "intervals"} for e in seen if e["event"] == "metrics")
    assert len(tail) == 1 and tail[0]["event"] == "end" and "id" not in tail[0]  # built from the task


async def test_events_of_a_cancelled_queued_task_and_bad_requests(settings: ApiSettings, start_api) -> None:
    server = await start_api(settings.model_copy(update={"max_tasks": 0}))
    async with AsyncEvalClient(server.url) as client, httpx.AsyncClient(base_url=server.url) as http:
        eval_id = await client.submit(body())
        await client.cancel(eval_id)
        events = await read_events(http, eval_id)
        assert [(e["event"], e["data"]["status"]) for e in events] == [
            ("status", "queued"), ("status", "cancelled"), ("end", "cancelled")]
        def blocking() -> list[dict[str, Any]]:
            with EvalClient(server.url) as sync:
                return list(sync.events(eval_id, last_event_id=events[0]["id"]))

        later = await asyncio.to_thread(blocking)  # the blocking client, resuming after the first event
        assert [(e["event"], e["data"]["status"]) for e in later] == [("status", "cancelled"), ("end", "cancelled")]
        assert [e["id"] for e in later] == [e["id"] for e in events[1:]]
        with pytest.raises(ApiError) as info:
            [e async for e in client.events("nope")]
        assert info.value.status == 404
        assert (await http.get("/v1/evals/nope/events")).status_code == 404
        r = await http.get(f"/v1/evals/{eval_id}/events", headers={"Last-Event-ID": "yesterday"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["header", "Last-Event-ID"]
        r = await http.get(f"/v1/evals/{eval_id}/events", params={"after": "-1"})
        assert r.status_code == 422


class Receiver:
    """A webhook receiver on 127.0.0.1: answers each POST with the next of ``answers`` (then 200)."""

    def __init__(self, answers: list[int]) -> None:
        self.answers = answers
        self.received: list[tuple[dict[str, str], bytes]] = []
        self.got = asyncio.Event()
        app = FastAPI()

        @app.post("/hook")
        async def hook(request: Request) -> Response:
            self.received.append((dict(request.headers), await request.body()))
            status = self.answers.pop(0) if self.answers else 200
            if status == 200:
                self.got.set()
            return Response(status_code=status)

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))

    async def __aenter__(self) -> Receiver:
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.should_exit = True
        await self.task
        self.sock.close()


async def test_the_completion_webhook_arrives_signed_after_a_retry(settings: ApiSettings, start_api) -> None:
    server = await start_api(settings.model_copy(update={"webhook_secret": SECRET}))
    async with Served(FakeOpenAI(solver)) as fake, Receiver([503]) as hooks, \
            AsyncEvalClient(server.url) as client:
        eval_id = await client.submit(spec(fake.url, webhook_url=hooks.url))
        state = await client.wait(eval_id, poll_s=0.05, timeout_s=60)
        await asyncio.wait_for(hooks.got.wait(), timeout=30)
    assert state["status"] == "succeeded"
    assert len(hooks.received) == 2  # a 503, then taken
    (h1, b1), (headers, raw) = hooks.received
    assert b1 == raw and h1["x-agentrl-delivery"] == headers["x-agentrl-delivery"]  # one delivery, retried
    expected = "sha256=" + hmac.new(SECRET.encode(), raw, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(headers["x-agentrl-signature"], expected)
    assert headers["x-agentrl-event"] == "eval.finished" and headers["content-type"] == "application/json"
    payload = json.loads(raw)
    assert payload["id"] == eval_id and payload["status"] == "succeeded"
    assert payload["metrics"] == state["metrics"] and payload["progress"]["done"] == 4


async def test_webhooks_only_to_allowed_hosts_and_with_a_secret(settings: ApiSettings, start_api) -> None:
    signed = await start_api(settings.model_copy(update={"webhook_secret": SECRET, "max_tasks": 0}))
    unsigned = await start_api(settings.model_copy(update={"max_tasks": 0}))
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{signed.url}/v1/evals", json=body(webhook_url="https://hooks.example.com/x"))
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "webhook_url"]
        assert "not allowed" in r.json()["detail"][0]["msg"]
        r = await http.post(f"{unsigned.url}/v1/evals", json=body(webhook_url="http://127.0.0.1:9/hook"))
        assert r.status_code == 422 and "AGENTRL_WEBHOOK_SECRET" in r.json()["detail"][0]["msg"]
        r = await http.post(f"{signed.url}/v1/evals", json=body(webhook_url="http://[::1]:9/hook"))
        assert r.status_code == 202
