"""run_eval through EvalServices against the real SGLang server of the session (tiny model, reached by URL),
the real ReTool environment and the real local sandbox: records are exact trajectories, metrics add up."""

from __future__ import annotations

import pytest

from agentrl.engine.base import SamplingParams
from agentrl.engine.openai_chat import OpenAIChatClient
from agentrl.eval import EvalServices, EvalSpec
from agentrl.sandbox import SandboxConfig

pytestmark = pytest.mark.sglang


async def test_evaluate_on_a_running_server(sglang_url: str, chat_tokenizer) -> None:
    spec = EvalSpec.model_validate({
        "environment": {"name": "retool"}, "dataset": {"name": "arithmetic:heldout", "n": 2, "seed": 1},
        "model": {"url": sglang_url}, "sampling": {"max_new_tokens": 24, "seed": 5},
        "samples_per_item": 2, "pass_k": [1, 2], "max_turns": 2})
    async with await EvalServices.create(sandbox=SandboxConfig(max_concurrency=2)) as services:
        result = await services.evaluate(spec)
        again = await services.evaluate(spec)
        assert services.engines.status() == [{"engine": f"url:{sglang_url}", "ready": True, "leases": 0}]  # reused
    assert result.status == again.status == "succeeded"
    assert len(result.records) == 4 == result.metrics["num_samples"]
    assert services.engines.status() == []  # released with the services
    for r in result.records:
        t = r.trajectory
        assert t is not None and r.ok and r.finish_reason in ("stop", "length", "max_turns")
        model_ids = [i for i, m in zip(t["token_ids"], t["loss_mask"]) if m]
        assert len(model_ids) == r.model_tokens > 0
        assert all(lp is not None and lp <= 0 for lp, m in zip(t["behavior_logprobs"], t["loss_mask"]) if m)
        first = t["turns"][0]  # token-in/token-out: the turn's text is the decoding of its own tokens
        assert chat_tokenizer.decode(t["token_ids"][first["token_start"]:first["token_end"]]) == first["text"]


async def test_evaluate_through_sglangs_own_openai_route(sglang_url: str) -> None:
    """``model.openai_url`` at the same server's ``/v1/chat/completions``: the text-level path end to end (model
    name from its ``/v1/models``, stop strings, usage counts), no token-level fields, said so."""
    spec = EvalSpec.model_validate({
        "environment": {"name": "retool"}, "dataset": {"name": "arithmetic:heldout", "n": 2, "seed": 1},
        "model": {"openai_url": f"{sglang_url}/v1"}, "sampling": {"max_new_tokens": 16, "seed": 5},
        "samples_per_item": 2, "pass_k": [1, 2], "max_turns": 2, "sample_retries": 0})
    async with await EvalServices.create(sandbox=SandboxConfig(max_concurrency=2)) as services:
        result = await services.evaluate(spec)
    assert result.status == "succeeded" and len(result.records) == 4
    m = result.metrics
    assert m["token_level"] is False and m["num_samples"] == 4 and m["num_errors"] == 0, result.records
    for key in ("mean_reward", "accuracy", "pass@1", "pass@2", "mean_turns", "mean_tool_calls"):
        assert m[key] is not None, key
    assert m["total_model_tokens"] > 0  # SGLang's usage
    for r in result.records:
        assert r.ok and r.token_level is False and r.trajectory is None and r.transcript is not None
        assert r.finish_reason in ("stop", "length", "max_turns") and 0 < r.model_tokens <= 16 * 2
        assert r.transcript[-1]["role"] == "assistant"
    # the stop string on the real route: cut here on the first call (whether the server reports matches is not
    # known yet), then sent and trimmed by SGLang, which reports it as matched_stop: the same text both times
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, stop=("\n",))  # the tiny model's greedy output
    async with OpenAIChatClient(f"{sglang_url}/v1") as client:
        first = await client.chat([{"role": "user", "content": "What is 6 * 7?"}], greedy)
        assert client.reports_stop is True
        second = await client.chat([{"role": "user", "content": "What is 6 * 7?"}], greedy)
    assert first.text == second.text == "\n" and first.matched_stop == second.matched_stop == "\n"
    assert second.completion_tokens == 1 < first.completion_tokens  # the server stopped: tokens saved
