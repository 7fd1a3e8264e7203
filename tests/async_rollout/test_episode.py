"""Episode state machine: token-in/token-out bookkeeping, masks, versions, budgets, aborted-turn resumption."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from agentrl.async_rollout.episode import EpisodeBudget, EpisodeRunner
from agentrl.engine.base import EngineFinish, GenerateResult, SamplingParams
from agentrl.env.base import Environment, Observation, StepResult
from agentrl.errors import EngineError, RewardError
from agentrl.rewards import RewardInput, RewardResult
from agentrl.types import FinishReason, Task, ToolCall, ToolResult


@dataclass
class ScriptedEngine:
    """Returns scripted turns (text, finish); records every request it got."""

    tok: Any
    script: list[tuple[str, EngineFinish]]
    version: int = 3
    requests: list[list[int]] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *, sticky_key=None):
        self.requests.append(list(input_ids))
        text, finish = self.script.pop(0)
        ids = self.tok.encode_text(text)
        if finish is EngineFinish.STOP and not text.endswith("</code>"):
            ids.append(self.tok.eos_token_id)
        self.outputs.append(ids)
        lps = [-0.01 * (i + 1) for i in range(len(ids))]
        return GenerateResult(ids, lps, [self.version] * len(ids), finish)

    async def update_weights(self, path: str, version: int) -> None: ...
    async def weight_version(self) -> int:
        return self.version
    async def aclose(self) -> None: ...


class EchoToolEnv(Environment):
    """Any turn ending in </code> gets an observation; other turns end the episode."""

    name = "echo"
    stop = ("</code>",)

    def __init__(self, hang: bool = False) -> None:
        self.hang = hang
        self.closed = False

    async def reset(self, task: Task):
        return [{"role": "user", "content": task.prompt}]

    async def step(self, text: str) -> StepResult:
        if not text.endswith("</code>"):
            return StepResult(None, True)
        call = ToolCall("python", {"code": text}, raw=text)
        return StepResult(Observation(text="\n<interpreter>\nOK\n</interpreter>\n"), False, (call,),
                          (ToolResult("python", "Finished", "OK"),))

    async def score(self, response: RewardInput) -> RewardResult:
        self.scored = response
        return RewardResult.scored(1.0 if "\\boxed{7}" in response.text else 0.0)

    async def close(self) -> None:
        self.closed = True



async def test_multi_turn_tokens_masks_logprobs_versions(chat_tokenizer):
    engine = ScriptedEngine(chat_tokenizer, [("Let me run <code>print(3+4)</code>", EngineFinish.STOP),
                                             ("So it is \\boxed{7}.", EngineFinish.STOP)])
    runner = EpisodeRunner(engine, chat_tokenizer, SamplingParams(max_new_tokens=64))
    env = EchoToolEnv()
    traj = await runner.run(env, Task(id="p", prompt="3+4?", answer="7"), env_name="echo")

    prompt = engine.requests[0]
    obs = chat_tokenizer.encode_text("\n<interpreter>\nOK\n</interpreter>\n")
    expected = prompt + engine.outputs[0] + obs + engine.outputs[1]
    assert traj.token_ids.tolist() == expected
    assert engine.requests[1] == prompt + engine.outputs[0] + obs  # 2nd turn saw exactly the 1st turn's tokens
    assert traj.prompt_len == len(prompt)
    assert traj.loss_mask.tolist() == [0] * len(prompt) + [1] * len(engine.outputs[0]) + [0] * len(obs) + [1] * len(
        engine.outputs[1])
    model_lps = [lp for lp, m in zip(traj.behavior_logprobs, traj.loss_mask) if m]
    assert model_lps == [-0.01 * (i + 1) for i in range(len(engine.outputs[0]))] + [
        -0.01 * (i + 1) for i in range(len(engine.outputs[1]))]
    assert set(traj.generated_versions) == {3} and all(v == -1 for v, m in zip(traj.weight_versions, traj.loss_mask)
                                                       if not m)
    assert traj.reward == 1.0 and traj.finish_reason is FinishReason.STOP
    assert env.scored.text == "Let me run <code>print(3+4)</code>So it is \\boxed{7}.<|im_end|>"
    assert env.scored.num_tool_calls == 1 and env.scored.finish_reason is FinishReason.STOP
    assert [t.observation_len for t in traj.turns] == [len(obs), 0]
    assert traj.turns[0].token_end - traj.turns[0].token_start == len(engine.outputs[0])


async def test_aborted_turn_is_resumed_and_keeps_per_token_versions(chat_tokenizer):
    engine = ScriptedEngine(chat_tokenizer, [("The answer", EngineFinish.ABORT), (" is \\boxed{7}.", EngineFinish.STOP)])
    runner = EpisodeRunner(engine, chat_tokenizer, SamplingParams(max_new_tokens=64))
    first = True

    orig = engine.generate

    async def versioned(ids, sampling, *, sticky_key=None):
        nonlocal first
        engine.version = 1 if first else 2
        first = False
        return await orig(ids, sampling, sticky_key=sticky_key)

    engine.generate = versioned  # type: ignore[method-assign]
    traj = await runner.run(EchoToolEnv(), Task(id="p", prompt="?", answer="7"))
    n1, n2 = len(engine.outputs[0]), len(engine.outputs[1])
    assert traj.generated_versions == [1] * n1 + [2] * n2
    assert engine.requests[1] == engine.requests[0] + engine.outputs[0]
    assert len(traj.turns) == 1 and traj.reward == 1.0


async def test_budgets_end_the_episode(chat_tokenizer):
    script = [("<code>x</code>", EngineFinish.STOP)] * 5
    engine = ScriptedEngine(chat_tokenizer, list(script))
    runner = EpisodeRunner(engine, chat_tokenizer, SamplingParams(), EpisodeBudget(max_turns=3))
    traj = await runner.run(EchoToolEnv(), Task(id="p", prompt="?"))
    assert traj.finish_reason is FinishReason.MAX_TURNS and len(traj.turns) == 3

    engine = ScriptedEngine(chat_tokenizer, [("a b c d e f g", EngineFinish.LENGTH)])
    traj = await EpisodeRunner(engine, chat_tokenizer, SamplingParams()).run(EchoToolEnv(), Task(id="p", prompt="?"))
    assert traj.finish_reason is FinishReason.LENGTH


async def test_prompt_over_context_budget_generates_nothing(chat_tokenizer):
    engine = ScriptedEngine(chat_tokenizer, [])
    runner = EpisodeRunner(engine, chat_tokenizer, SamplingParams(), EpisodeBudget(max_context_tokens=16))
    traj = await runner.run(EchoToolEnv(), Task(id="p", prompt="word " * 50))
    assert engine.requests == [] and traj.finish_reason is FinishReason.LENGTH and traj.num_model_tokens == 0


def test_tool_role_observation_is_the_chat_template_delta(chat_tokenizer):
    ids = chat_tokenizer.encode_messages_delta([{"role": "tool", "content": "42"}])
    assert chat_tokenizer.decode(ids) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"


async def test_reward_infrastructure_failure_raises_instead_of_scoring_zero(chat_tokenizer):
    class Broken(EchoToolEnv):
        async def score(self, response):
            return RewardResult.infra_error("sandbox down")

    engine = ScriptedEngine(chat_tokenizer, [("\\boxed{7}", EngineFinish.STOP)])
    with pytest.raises(RewardError, match="task 'p'.*sandbox down"):
        await EpisodeRunner(engine, chat_tokenizer, SamplingParams()).run(Broken(), Task(id="p", prompt="?"))
    assert len(engine.requests) == 1  # the episode ran; only its score is missing


@dataclass
class PrefillingEngine(ScriptedEngine):
    """A ScriptedEngine that can prefill; ``log`` orders its prefill and generate calls, ``gate`` holds prefills."""

    log: list[tuple[str, str | None, int]] = field(default_factory=list)
    gate: Any = None
    fail: bool = False

    async def prefill(self, input_ids: Sequence[int], *, sticky_key=None) -> None:
        self.log.append(("prefill", sticky_key, len(input_ids)))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise EngineError("POST http://s/generate failed with HTTP 500")

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *, sticky_key=None):
        self.log.append(("generate", sticky_key, len(input_ids)))
        return await super().generate(input_ids, sampling, sticky_key=sticky_key)


async def test_the_samples_of_a_group_prefill_their_prompt_once_before_generating(chat_tokenizer):
    import asyncio

    engine = PrefillingEngine(chat_tokenizer, [("So it is \\boxed{7}.", EngineFinish.STOP)] * 4, gate=asyncio.Event())
    runner = EpisodeRunner(engine, chat_tokenizer, SamplingParams(max_new_tokens=64), share_prefill=True)
    task = Task(id="p", prompt="3+4?", answer="7")
    group = [asyncio.create_task(runner.run(EchoToolEnv(), task, group_id="g1")) for _ in range(4)]
    async with asyncio.timeout(10):
        while not engine.log:
            await asyncio.sleep(0.01)
    for _ in range(20):  # every sample has reached the prefill by now (nothing else to wait for in them)
        await asyncio.sleep(0)
    assert engine.log == [("prefill", "g1", len(chat_tokenizer.encode_prompt([{"role": "user",
                                                                                "content": "3+4?"}])))]
    group[0].cancel()  # a sample restarted for new weights: the prefill goes on for the others
    engine.gate.set()  # the prefill is done: now every sample generates, finding the prompt cached
    done = await asyncio.gather(*group, return_exceptions=True)
    assert isinstance(done[0], asyncio.CancelledError)
    assert [e[0] for e in engine.log] == ["prefill"] + ["generate"] * 3
    assert all(t.reward == 1.0 for t in done[1:])  # type: ignore[union-attr]
    # a group that comes back later (retried, the cache flushed by a weight update meanwhile) prefills again
    await runner.run(EchoToolEnv(), task, group_id="g1")
    assert [e[:2] for e in engine.log[4:]] == [("prefill", "g1"), ("generate", "g1")]
    assert not runner.shared_prefill._pending  # type: ignore[union-attr]  # done prefills are forgotten


async def test_a_failed_shared_prefill_leaves_the_samples_generating_as_before(chat_tokenizer):
    import asyncio

    engine = PrefillingEngine(chat_tokenizer, [("So it is \\boxed{7}.", EngineFinish.STOP)] * 3, fail=True)
    runner = EpisodeRunner(engine, chat_tokenizer, SamplingParams(max_new_tokens=64), share_prefill=True)
    task = Task(id="p", prompt="3+4?", answer="7")
    trajs = await asyncio.gather(*(runner.run(EchoToolEnv(), task, group_id="g") for _ in range(3)))
    assert [e[0] for e in engine.log] == ["prefill"] + ["generate"] * 3 and all(t.reward == 1.0 for t in trajs)
    # off, or on an engine that cannot prefill, or for an episode outside a group: no prefill request
    engine = PrefillingEngine(chat_tokenizer, [("So it is \\boxed{7}.", EngineFinish.STOP)] * 2)
    await EpisodeRunner(engine, chat_tokenizer, SamplingParams()).run(EchoToolEnv(), task, group_id="g")
    await EpisodeRunner(engine, chat_tokenizer, SamplingParams(), share_prefill=True).run(EchoToolEnv(), task)
    assert [e[0] for e in engine.log] == ["generate", "generate"]
    assert EpisodeRunner(ScriptedEngine(chat_tokenizer, []), chat_tokenizer, SamplingParams(),
                         share_prefill=True).shared_prefill is None
