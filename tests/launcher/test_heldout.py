"""A run's held-out evaluation through agentrl.eval, with the real ReTool environment, local sandbox and math checker;
the engine is scripted per prompt, so the figures and the ``eval_<label>.jsonl`` lines are known exactly."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from agentrl.engine.base import EngineFinish, GenerateResult, SamplingParams
from agentrl.env.registry import EnvResources
from agentrl.errors import EngineError
from agentrl.launcher.config import RunConfig, load_config
from agentrl.launcher.heldout import heldout_eval, heldout_plan, write_records
from agentrl.rewards import MathVerifier
from agentrl.sandbox.local import LocalSandbox
from agentrl.types import Task

#: prompt -> the model's answer after running its code; None: the engine fails on this prompt
ANSWERS = {"What is 6 * 7?": "42", "Compute 6 times 7.": "41", "What is 5 * 5?": None}
TASKS = [Task(id=f"h{i}", prompt=p, answer="42" if "6" in p else "25") for i, p in enumerate(ANSWERS)]
FIGURES = {"n", "accuracy", "reward_mean", "turns_mean", "tool_calls_mean", "errors"}  # evals.json per label


@dataclass
class PromptEngine:
    """Turn 0 runs ``print(6 * 7)``, turn 1 answers ``ANSWERS[prompt]``; records each request's sampling."""

    tok: Any
    sampling: list[SamplingParams] = field(default_factory=list)

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *,
                       sticky_key: str | None = None) -> GenerateResult:
        self.sampling.append(sampling)
        text = self.tok.decode(list(input_ids))
        answer = next(a for p, a in ANSWERS.items() if p in text)
        if answer is None:
            raise EngineError("scripted engine failure")
        if text.count("\n</interpreter>"):  # a tool answer came back: the final turn
            ids = [*self.tok.encode_text(f"The answer is \\boxed{{{answer}}}."), self.tok.eos_token_id]
        else:
            ids = self.tok.encode_text("Let me compute.\n<code>\nprint(6 * 7)\n</code>")
        return GenerateResult(ids, [-0.5] * len(ids), [0] * len(ids), EngineFinish.STOP)

    async def update_weights(self, path: str, version: int) -> None: ...

    async def weight_version(self) -> int:
        return 0

    async def aclose(self) -> None: ...


@pytest.fixture(scope="module")
async def resources() -> AsyncIterator[EnvResources]:
    async with LocalSandbox(max_concurrency=2) as sandbox, MathVerifier(workers=1) as verifier:
        yield EnvResources(sandbox=sandbox, verifier=verifier)


def config() -> RunConfig:
    return load_config(None, ["env.name=retool", "env.options.code_timeout_s=5", "rollout.temperature=1.0",
                              "rollout.top_p=0.9", "rollout.max_new_tokens=64", "rollout.max_turns=3",
                              "rollout.max_running_groups=2"])


async def test_figures_and_records_keep_their_meaning(resources, chat_tokenizer, tmp_path: Path) -> None:
    engine = PromptEngine(chat_tokenizer)
    out = tmp_path / "eval_sft.jsonl"
    figures, records = await heldout_eval(config(), TASKS, engine=engine, tokenizer=chat_tokenizer,
                                          resources=resources)
    write_records(out, records)
    assert set(figures) == FIGURES
    assert figures == {"n": 2, "accuracy": 0.5, "reward_mean": 0.5, "turns_mean": 2.0, "tool_calls_mean": 1.0,
                       "errors": 1}
    assert {(s.temperature, s.top_p, s.max_new_tokens) for s in engine.sampling} == {(0.0, 0.9, 64)}  # greedy
    right, wrong, failed = (json.loads(line) for line in out.read_text().splitlines())  # in task order
    assert right["task_id"] == "h0" and right["prompt"] == TASKS[0].prompt and right["answer"] == "42"
    assert right["correct"] is True and right["reward"] == 1.0 and right["finish_reason"] == "stop"
    assert len(right["turns"]) == 2 and "\\boxed{42}" in right["turns"][1]
    assert right["tools"][0] and "42" in right["tools"][0][0] and right["tools"][1] == []
    assert wrong["correct"] is False and wrong["reward"] == 0.0
    assert set(failed) == {"task_id", "prompt", "answer", "error"} and "scripted engine failure" in failed["error"]


async def test_infrastructure_failures_are_counted_and_never_stop_the_run(resources, chat_tokenizer) -> None:
    down = [Task(id=f"d{i}", prompt="What is 5 * 5?", answer="25") for i in range(20)]  # > 16 in a row
    figures, records = await heldout_eval(config(), down, engine=PromptEngine(chat_tokenizer),
                                          tokenizer=chat_tokenizer, resources=resources)
    assert figures == {"n": 0, "accuracy": 0.0, "reward_mean": 0.0, "turns_mean": 0.0, "tool_calls_mean": 0.0,
                       "errors": 20}
    assert len(records) == 20 and all("error" in r for r in records)


def test_the_plan_samples_like_the_rollout_but_greedily() -> None:
    cfg = load_config(None, ["rollout.top_k=20", "rollout.max_resumes=2", "rollout.temperature=0.8",
                             "rollout.max_running_groups=3"])
    plan = heldout_plan(cfg)
    assert plan.sampling == replace(cfg.rollout.sampling, temperature=0.0) and plan.budget is cfg.rollout.budget
    assert plan.max_concurrency == 3
