"""run_eval with the real ReTool environment, the real local sandbox and the real math checker; the engine is
scripted (right/wrong answers and failures chosen per sample) so the expected metrics are known exactly."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from eval_support import ScriptedEngine

from agentrl.env.registry import Registry
from agentrl.env.retool import ReToolEnv
from agentrl.eval import EvalSpec, SpecError, TooManyErrors, UnknownEnvironmentError, run_eval
from agentrl.eval.base import SampleRecord
from agentrl.rewards import RewardInput, RewardResult


def spec(**kw: Any) -> EvalSpec:
    body: dict[str, Any] = {
        "environment": {"name": "retool", "options": {"code_timeout_s": 5}},
        "dataset": {"items": [{"prompt": "What is 6 * 7?", "answer": "42"},
                              {"prompt": "Compute 6 times 7.", "answer": "42"}]},
        "model": {"url": "http://127.0.0.1:9"},  # never reached: the tests inject a scripted engine
        "sampling": {"seed": 0, "max_new_tokens": 64},
        "samples_per_item": 4, "pass_k": [1, 2, 4], "max_turns": 4, "max_concurrency": 4,
    }
    body.update(kw)
    return EvalSpec.model_validate(body)


def script(seed: int, turn: int) -> str | None:
    """Seeds 0..3 are item 0's samples, 4..7 item 1's. Even seeds answer right; seed % 4 == 3 writes code that
    raises (a tool error; it still answers)."""
    if turn == 0:
        code = "1 / 0" if seed % 4 == 3 else "print(6 * 7)"
        return f"Let me compute.\n<code>\n{code}\n</code>"
    return f"The answer is \\boxed{{{42 if seed % 2 == 0 else 41}}}."


async def test_metrics_and_records_of_a_known_run(resources, chat_tokenizer) -> None:
    engine = ScriptedEngine(chat_tokenizer, script)
    seen: list[SampleRecord] = []

    async def on_record(r: SampleRecord) -> None:
        seen.append(r)

    result = await run_eval(spec(), engine=engine, tokenizer=chat_tokenizer, resources=resources,
                            on_record=on_record)
    m = result.metrics
    assert result.status == "succeeded" and result.total == 8 and len(result.records) == 8 == len(seen)
    assert (m["num_items"], m["num_samples"], m["num_errors"]) == (2, 8, 0)
    assert m["mean_reward"] == 0.5 and m["accuracy"] == 0.5
    assert m["pass@1"] == 0.5 and m["pass@2"] == pytest.approx(1 - 1 / 6) and m["pass@4"] == 1.0
    assert (m["mean_turns"], m["mean_tool_calls"], m["tool_calls"], m["tool_errors"]) == (2.0, 1.0, 8, 2)
    assert m["tool_error_rate"] == 0.25
    assert m["total_model_tokens"] == sum(r.model_tokens for r in result.records) > 0
    by_key = {r.key: r for r in result.records}
    assert sorted(by_key) == [f"{i}:{s}" for i in range(2) for s in range(4)]
    right, raised = by_key["0:0"], by_key["0:3"]
    assert right.correct and right.reward == 1.0 and right.reward_breakdown == {"correct": 1.0}
    assert not raised.correct and raised.num_tool_errors == 1
    traj = right.trajectory
    assert traj is not None and traj["prompt_len"] == right.prompt_tokens
    assert len(traj["token_ids"]) == right.prompt_tokens + right.response_tokens
    assert sum(traj["loss_mask"]) == right.model_tokens < right.response_tokens  # interpreter tokens masked
    first = traj["turns"][0]
    assert first["tool_calls"][0]["arguments"] == {"code": "print(6 * 7)"}
    assert first["tool_results"][0]["status"] == "Finished" and "42" in first["tool_results"][0]["output"]
    assert "ZeroDivisionError" in raised.trajectory["turns"][0]["tool_results"][0]["output"]  # real sandbox
    assert "\\boxed{42}" in right.response and "<interpreter>" not in right.response


async def test_resume_skips_stored_samples_and_gives_the_same_metrics(resources, chat_tokenizer) -> None:
    full = await run_eval(spec(), engine=ScriptedEngine(chat_tokenizer, script), tokenizer=chat_tokenizer,
                          resources=resources)
    stored = [r for r in full.records if r.item_index == 0 or r.sample_index < 2]
    engine = ScriptedEngine(chat_tokenizer, script)
    resumed = await run_eval(spec(), engine=engine, tokenizer=chat_tokenizer, resources=resources,
                             completed=stored)
    assert engine.calls == 2 * 2  # two samples left, two turns each
    assert resumed.metrics == full.metrics
    assert sorted(r.key for r in resumed.records) == sorted(r.key for r in full.records)


async def test_cancel_stops_running_episodes_and_keeps_what_finished(resources, chat_tokenizer) -> None:
    engine = ScriptedEngine(chat_tokenizer, script, delay_s=0.3)
    cancel = asyncio.Event()
    done: list[SampleRecord] = []

    async def on_record(r: SampleRecord) -> None:
        done.append(r)
        if len(done) == 2:
            cancel.set()

    result = await run_eval(spec(max_concurrency=2), engine=engine, tokenizer=chat_tokenizer,
                            resources=resources, on_record=on_record, cancel=cancel)
    assert result.status == "cancelled"
    assert 2 <= len(result.records) < 8 and result.metrics["num_samples"] == len(result.records)
    calls = engine.calls
    await asyncio.sleep(0.5)
    assert engine.calls == calls and engine.in_flight == 0  # nothing keeps running after the return


async def test_failed_samples_are_retried_then_recorded_as_errors(resources, chat_tokenizer) -> None:
    attempts: dict[int, int] = {}

    def flaky(seed: int, turn: int) -> str | None:
        if seed == 5:
            return None  # always fails: an error record, left out of the metrics
        if seed == 6 and turn == 0:
            attempts[seed] = attempts.get(seed, 0) + 1
            if attempts[seed] == 1:
                return None  # fails once: the retry succeeds
        return script(seed, turn)

    result = await run_eval(spec(sample_retries=1), engine=ScriptedEngine(chat_tokenizer, flaky),
                            tokenizer=chat_tokenizer, resources=resources)
    errors = [r for r in result.records if not r.ok]
    assert [r.key for r in errors] == ["1:1"] and "scripted engine failure" in (errors[0].error or "")
    assert errors[0].attempts == 2
    assert result.metrics["num_errors"] == 1 and result.metrics["num_samples"] == 7
    assert result.metrics["pass@4"] == 1.0  # item 1 has 3 ok samples: left out of pass@4
    assert {r.key: r.attempts for r in result.records}["1:2"] == 2


async def test_a_reward_that_cannot_be_computed_is_an_error_sample_not_a_zero(resources, chat_tokenizer) -> None:
    class CheckerDown(ReToolEnv):
        async def score(self, response: RewardInput) -> RewardResult:
            if self.task is not None and self.task.prompt.startswith("Compute"):
                return RewardResult.infra_error("the math checker pool died")
            return await super().score(response)

    registry = Registry()
    registry.register_env("retool", CheckerDown)
    result = await run_eval(spec(sample_retries=1), engine=ScriptedEngine(chat_tokenizer, script),
                            tokenizer=chat_tokenizer, resources=resources, registry=registry)
    errors = [r for r in result.records if not r.ok]
    assert sorted(r.key for r in errors) == [f"1:{s}" for s in range(4)]  # every sample of item 1
    assert all(r.attempts == 2 and r.reward is None and r.correct is None for r in errors)
    assert all("RewardError" in (r.error or "") and "math checker pool died" in (r.error or "") for r in errors)
    assert (result.metrics["num_errors"], result.metrics["num_samples"], result.metrics["num_items"]) == (4, 4, 1)


async def test_an_engine_that_keeps_failing_stops_the_evaluation(resources, chat_tokenizer) -> None:
    engine = ScriptedEngine(chat_tokenizer, lambda seed, turn: None)
    with pytest.raises(TooManyErrors, match="3 samples failed in a row"):
        await run_eval(spec(max_consecutive_errors=3, sample_retries=0, max_concurrency=1), engine=engine,
                       tokenizer=chat_tokenizer, resources=resources)
    assert engine.calls == 3


async def test_concurrency_is_bounded_per_eval_and_globally(resources, chat_tokenizer) -> None:
    engine = ScriptedEngine(chat_tokenizer, script, delay_s=0.05)
    await run_eval(spec(max_concurrency=2), engine=engine, tokenizer=chat_tokenizer, resources=resources)
    assert engine.max_in_flight == 2
    shared = ScriptedEngine(chat_tokenizer, script, delay_s=0.05)
    limiter = asyncio.Semaphore(3)
    await asyncio.gather(*(run_eval(spec(max_concurrency=4), engine=shared, tokenizer=chat_tokenizer,
                                    resources=resources, limiter=limiter, id_prefix=f"e{i}-") for i in range(2)))
    assert shared.max_in_flight == 3


async def test_environment_errors(resources, chat_tokenizer) -> None:
    engine = ScriptedEngine(chat_tokenizer, script)
    with pytest.raises(UnknownEnvironmentError, match="registered environments: .*retool") as info:
        await run_eval(spec(environment={"name": "nope"}), engine=engine, tokenizer=chat_tokenizer,
                       resources=resources)
    assert "retool" in info.value.known
    with pytest.raises(SpecError, match="bogus") as bad:
        await run_eval(spec(environment={"name": "retool", "options": {"bogus": 1}}), engine=engine,
                       tokenizer=chat_tokenizer, resources=resources)
    assert bad.value.loc == ("environment", "options") and engine.calls == 0
