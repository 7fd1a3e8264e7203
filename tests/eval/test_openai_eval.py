"""Evaluations of an ``openai_url`` model against a fake OpenAI-compatible server (real HTTP on 127.0.0.1), the
real ReTool environment, the local sandbox and the math checker: the episode loop, scoring, metrics with
``token_level: false``, and what a server that errors, hangs or is not there does (error samples, never 0).
The real server — SGLang's own OpenAI route — is in test_sglang_eval.py."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from agentrl.eval import EvalServices, EvalSpec, SpecError
from agentrl.sandbox import SandboxConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from openai_support import Error, FakeOpenAI, Reply, Served, closed_port_url  # noqa: E402

ITEMS = [{"prompt": "What is 6 * 7?", "answer": "42"}, {"prompt": "What is 2 + 3?", "answer": "5"}]


def spec(url: str, **kw: Any) -> EvalSpec:
    body: dict[str, Any] = {
        "environment": {"name": "retool"}, "dataset": {"items": ITEMS},
        "model": {"openai_url": url, "openai_model": "fake-model"},
        "sampling": {"max_new_tokens": 64, "temperature": 0.0}, "samples_per_item": 2, "pass_k": [1, 2],
        "max_turns": 3, "sample_retries": 0, "max_consecutive_errors": 100}
    body.update(kw)
    return EvalSpec.model_validate(body)


def solver(body: dict[str, Any], turn: int) -> str:
    """Turn 0 runs code (and rambles on past ``</code>``); turn 1 boxes what the interpreter printed."""
    question = next(m["content"] for m in body["messages"] if m["role"] == "user")
    a, op, b = question.removeprefix("What is ").rstrip("?").split()
    if turn == 0:
        return f"<code>print({a} {op} {b})</code>\n<interpreter>hallucinated</interpreter>"
    printed = body["messages"][-1]["content"].split("\n")[1]
    return f"The answer is \\boxed{{{printed}}}."


@pytest.mark.parametrize("style", ["sglang", "plain"])
async def test_retool_episodes_through_chat_completions(style: str) -> None:
    fake = FakeOpenAI(solver, style=style)
    async with Served(fake), await EvalServices.create(sandbox=SandboxConfig(max_concurrency=2)) as services:
        result = await services.evaluate(spec(fake.url))
    assert result.status == "succeeded" and len(result.records) == 4
    m = result.metrics
    assert m["token_level"] is False and m["num_samples"] == 4 and m["num_errors"] == 0
    assert m["accuracy"] == m["pass@1"] == m["pass@2"] == m["mean_reward"] == 1.0
    assert m["mean_turns"] == 2.0 and m["mean_tool_calls"] == 1.0 and m["tool_errors"] == 0
    assert m["finish_reasons"] == {"stop": 4} and m["total_model_tokens"] > 0
    for r in result.records:
        assert r.ok and r.correct and r.token_level is False and r.trajectory is None
        assert r.response.startswith("<code>print(") and "hallucinated" not in r.response
        assert r.transcript is not None
        roles = [msg["role"] for msg in r.transcript]
        assert roles == ["system", "user", "assistant", "user", "assistant"]
        assert r.transcript[3]["content"].startswith("<interpreter>\n")  # the sandbox's answer, as a user turn
        assert r.model_tokens > 0 and r.prompt_tokens > 0
    assert all(req["model"] == "fake-model" for req in fake.requests)


async def test_a_wrong_answer_scores_zero_and_an_erroring_server_records_errors() -> None:
    fake = FakeOpenAI(lambda body, turn: "\\boxed{7}")
    async with Served(fake), await EvalServices.create(sandbox=SandboxConfig(max_concurrency=2)) as services:
        wrong = await services.evaluate(spec(fake.url, keep_trajectories=False))
        assert wrong.metrics["accuracy"] == 0.0 and wrong.metrics["num_errors"] == 0
        assert all(r.transcript is None for r in wrong.records)
        fake.script = lambda body, turn: Error(500) if turn == 1 else solver(body, turn)
        broken = await services.evaluate(spec(fake.url, sample_retries=1))
    assert broken.status == "succeeded" and broken.metrics["num_errors"] == 4
    assert broken.metrics["num_samples"] == 0 and broken.metrics["accuracy"] is None  # never scored as 0
    assert broken.metrics["token_level"] is False
    for r in broken.records:
        assert r.status == "error" and r.attempts == 2 and r.token_level is False
        assert "HTTP 500" in (r.error or "") and r.reward is None


async def test_a_server_that_hangs_or_is_not_there_fails_the_samples_not_the_submission() -> None:
    fake = FakeOpenAI(lambda body, turn: Reply("late", delay_s=3.0))
    async with Served(fake), await EvalServices.create(sandbox=SandboxConfig(max_concurrency=2)) as services:
        slow = await services.evaluate(spec(fake.url, model={"openai_url": fake.url, "openai_model": "m",
                                                             "openai_timeout_s": 0.3}))
        assert slow.metrics["num_errors"] == 4 and all("EngineTimeout" in (r.error or "") for r in slow.records)
        gone = spec(closed_port_url(), max_consecutive_errors=3)
        await services.prepare(gone)  # accepted: the server may come up later
        from agentrl.eval import TooManyErrors
        with pytest.raises(TooManyErrors, match="cannot connect to the OpenAI-compatible server"):
            await services.evaluate(gone)


async def test_the_api_key_comes_from_the_named_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeOpenAI(solver)
    s = spec("http://127.0.0.1:9/v1", model={"openai_url": "http://127.0.0.1:9/v1", "api_key_env": "AGENTRL_TEST_KEY"})
    async with Served(fake), await EvalServices.create(sandbox=SandboxConfig(max_concurrency=2)) as services:
        monkeypatch.delenv("AGENTRL_TEST_KEY", raising=False)
        with pytest.raises(SpecError) as info:
            await services.prepare(s)
        assert info.value.loc == ("model", "api_key_env") and "AGENTRL_TEST_KEY" in info.value.message
        monkeypatch.setenv("AGENTRL_TEST_KEY", "sk-secret")
        keyed = spec(fake.url, model={"openai_url": fake.url, "api_key_env": "AGENTRL_TEST_KEY"}, samples_per_item=1,
                     pass_k=[1])
        result = await services.evaluate(keyed)
    assert result.metrics["accuracy"] == 1.0
    assert {h["authorization"] for h in fake.headers} == {"Bearer sk-secret"}
    assert "sk-secret" not in keyed.model_dump_json()  # the spec (and so the stored task) holds only the name
    assert all(req["model"] == "fake-model" for req in fake.requests)  # from GET /models
