"""``model.openai_url`` over REST: a real uvicorn API, a real Redis, a fake OpenAI-compatible server (real HTTP),
the local sandbox. The task's metrics and records say ``token_level: false``; an unreachable server is accepted
at submission and fails the samples with a clear message; the key's variable must be set, the key itself never
travels. (SGLang's own OpenAI route: tests/eval/test_sglang_eval.py.)"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_support import body

from agentrl.api import ApiSettings
from agentrl.client import AsyncEvalClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from openai_support import FakeOpenAI, Served, closed_port_url  # noqa: E402


def solver(body: dict[str, Any], turn: int) -> str:
    question = next(m["content"] for m in body["messages"] if m["role"] == "user")
    a, op, b = question.removeprefix("What is ").rstrip("?").split()
    if turn == 0:
        return f"<code>print({a} {op} {b})</code>"
    return f"\\boxed{{{body['messages'][-1]['content'].splitlines()[1]}}}"


async def test_an_openai_model_task_succeeds_without_token_level_records(settings: ApiSettings, start_api) -> None:
    server = await start_api(settings)
    async with Served(FakeOpenAI(solver)) as fake, AsyncEvalClient(server.url) as client:
        eval_id = await client.submit(body(model={"openai_url": fake.url, "openai_model": "fake-model"}))
        state = await client.wait(eval_id, poll_s=0.05, timeout_s=60)
        records = [r async for r in client.iter_results(eval_id, page_size=10)]
        light = (await client.results(eval_id, trajectories=False))["records"]
    assert state["status"] == "succeeded", state
    assert len(light) == 4 and all(r["transcript"] is None and r["token_level"] is False for r in light)
    m = state["metrics"]
    assert m["token_level"] is False and m["accuracy"] == 1.0 and m["mean_tool_calls"] == 1.0
    assert state["spec"]["model"]["openai_url"] == fake.url
    assert len(records) == 4
    for r in records:
        assert r["token_level"] is False and r["trajectory"] is None and r["correct"] is True
        assert [msg["role"] for msg in r["transcript"]][-3:] == ["assistant", "user", "assistant"]


async def test_an_unreachable_server_is_accepted_and_fails_the_samples(settings: ApiSettings, start_api) -> None:
    server = await start_api(settings)
    async with AsyncEvalClient(server.url) as client:
        eval_id = await client.submit(body(model={"openai_url": closed_port_url()}, sample_retries=0,
                                           max_consecutive_errors=2))
        state = await client.wait(eval_id, poll_s=0.05, timeout_s=60)
        records = [r async for r in client.iter_results(eval_id, page_size=10)]
    assert state["status"] == "failed" and "cannot connect to the OpenAI-compatible server" in state["error"]
    assert records and all(r["status"] == "error" and r["token_level"] is False for r in records)
    assert state["metrics"]["num_samples"] == 0 and state["metrics"]["token_level"] is False


@pytest.mark.parametrize("model, loc, words", [
    ({"openai_url": "http://127.0.0.1:9/v1", "api_key_env": "AGENTRL_SURELY_UNSET"}, ["body", "model", "api_key_env"],
     "is not set"),
    ({"openai_url": "http://user:sk-123@127.0.0.1:9/v1"}, ["body", "model", "openai_url"], "credentials"),
    ({"openai_url": "file:///etc/passwd"}, ["body", "model", "openai_url"], "pattern"),
    ({"openai_url": "http://127.0.0.1:9/v1", "url": "http://127.0.0.1:9"}, ["body", "model"], "exactly one"),
    ({"url": "http://127.0.0.1:9", "openai_model": "x"}, ["body", "model"], "openai_url"),
])
async def test_bad_openai_models_are_422_naming_the_field(settings: ApiSettings, start_api, model: dict, loc: list,
                                                          words: str) -> None:
    server = await start_api(settings)
    async with httpx.AsyncClient(base_url=server.url) as http:
        resp = await http.post("/v1/evals", json=body(model=model))
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert any(d["loc"][: len(loc)] == loc and words in d["msg"] for d in detail), detail


async def test_agentrl_eval_runs_an_openai_model_locally(tmp_path: Path) -> None:
    import json

    import yaml
    from typer.testing import CliRunner

    from agentrl.cli import app

    async with Served(FakeOpenAI(solver)) as fake:
        cfg = tmp_path / "eval.yaml"
        cfg.write_text(yaml.safe_dump(body(model={"openai_url": fake.url}, name="cli-openai")))
        out = tmp_path / "records.jsonl"
        res = await asyncio.to_thread(CliRunner().invoke, app, ["eval", str(cfg), "samples_per_item=1", "pass_k=[1]",
                                                                "--out", str(out), "--runs-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    assert summary["status"] == "succeeded" and summary["metrics"]["token_level"] is False
    assert summary["metrics"]["accuracy"] == 1.0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 2 and all(r["token_level"] is False and r["transcript"] for r in lines)
