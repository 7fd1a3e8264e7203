"""The ReTool environment against the REAL local sandbox and the real math checker: code runs, state carries
across turns, a hostile infinite loop ends as a timeout observation, the interpreter's output never counts as the
model's answer."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.async_rollout.episode import EpisodeRunner
from agentrl.engine.base import EngineFinish, GenerateResult, SamplingParams
from agentrl.env.registry import EnvResources
from agentrl.env.retool import ReToolEnv
from agentrl.rewards import RewardInput
from agentrl.types import FinishReason, Task


@pytest.fixture(scope="module")
def resources(env_resources: EnvResources) -> EnvResources:
    return env_resources


async def test_code_runs_and_state_carries_across_turns(resources):
    async with ReToolEnv(resources) as env:
        await env.reset(Task(id="t", prompt="?", answer="391"))
        first = await env.step("Let me set it.\n<code>\nx = 17 * 23\nprint(x)\n</code>")
        second = await env.step("<code>print(x + 0)</code>")
    assert first.observation.text == "\n<interpreter>\n391\n</interpreter>\n"
    assert second.observation.text == "\n<interpreter>\n391\n</interpreter>\n"
    assert first.tool_results[0].status == "Finished" and not first.done


async def test_errors_and_malformed_calls_are_observations(resources):
    async with ReToolEnv(resources) as env:
        await env.reset(Task(id="t", prompt="?", answer="1"))
        err = await env.step("<code>1/0</code>")
        bad = await env.step("<code>print(1)")
    assert "ZeroDivisionError" in err.observation.text and err.tool_results[0].status == "Error"
    assert "not closed" in bad.observation.text and bad.tool_calls[0].error


async def test_code_that_does_not_parse_is_a_malformed_call_answered_as_the_interpreter_would(resources):
    async with ReToolEnv(resources, format_weight=0.5) as env:
        await env.reset(Task(id="t", prompt="?", answer="46"))
        unclosed = await env.step("<code>\nprint(1 * 34 + 12\n</code>")
        indented = await env.step("<code>\n  x = 1\ny = 2\n</code>")
        fine = await env.step("<code>print(1 * 34 + 12)</code>")
        text = "<code>\nprint(1 * 34 + 12\n</code>The answer is \\boxed{46}."
        score = await env.score(RewardInput(text=text, num_tool_calls=1, num_malformed_tool_calls=1))
    assert unclosed.observation.text == "\n<interpreter>\nSyntaxError: '(' was never closed\n</interpreter>\n"
    assert unclosed.tool_calls[0].error and unclosed.tool_results[0].status == "malformed"
    assert indented.tool_results[0].output.startswith("IndentationError: ")
    assert fine.tool_results[0].status == "Finished" and fine.tool_calls[0].error is None
    assert env.calls == 3  # each counts against the tool-call budget, as a run would
    # the format half of the reward sees the bad call: correct 1 + 0.5 * mean(answer present 1, well formed 0)
    assert score.score == pytest.approx(1.25)


@pytest.mark.parametrize("code", ["print(1 * 34 + 12", "  x = 1\ny = 2", "print(1))", "def f(:\n    pass",
                                  "x = 1 +"])
async def test_the_syntax_check_says_what_the_sandboxed_interpreter_says(resources, code):
    from agentrl.env.retool import render_run_output, syntax_error
    from agentrl.sandbox.base import Limits, RunRequest

    result = await resources.sandbox.run(RunRequest(code=code, limits=Limits(time_s=5.0)))
    assert result.run_status.value == "Error"
    assert syntax_error(code) == render_run_output(result.stdout, result.stderr, "Error", max_chars=1024)


async def test_hostile_infinite_loop_becomes_a_timeout_observation(resources):
    async with ReToolEnv(resources, code_timeout_s=1.0) as env:
        await env.reset(Task(id="t", prompt="?", answer="1"))
        result = await asyncio.wait_for(env.step("<code>\nwhile True:\n    pass\n</code>"), 60)
        after = await env.step("<code>print('alive')</code>")  # the session recovers for the next turn
    assert result.tool_results[0].status == "TimeLimitExceeded"
    assert "TimeoutError" in result.observation.text
    assert "alive" in after.observation.text


async def test_reward_reads_the_models_text_not_the_interpreters(resources):
    async with ReToolEnv(resources) as env:
        await env.reset(Task(id="t", prompt="?", answer="391"))
        right = await env.score(RewardInput(text="The answer is \\boxed{391}."))
        # the interpreter printed \boxed{391}, but the model's own text says 390
        wrong = await env.score(RewardInput(text="<code>print('\\\\boxed{391}')</code>So \\boxed{390}."))
    assert right.ok and right.score == 1.0
    assert wrong.ok and wrong.score == 0.0


class HostileEngine:
    """A model that writes an infinite loop, then answers."""

    def __init__(self, tok):
        self.tok = tok
        self.turns = ["<code>\nwhile True:\n    pass\n</code>", "The answer is \\boxed{2}."]

    async def generate(self, input_ids, sampling, *, sticky_key=None):
        ids = self.tok.encode_text(self.turns.pop(0))
        if not self.turns:
            ids.append(self.tok.eos_token_id)
        return GenerateResult(ids, [-0.1] * len(ids), [0] * len(ids), EngineFinish.STOP)


async def test_episode_with_hostile_code_ends_with_a_timeout_observation(resources, chat_tokenizer):
    runner = EpisodeRunner(HostileEngine(chat_tokenizer), chat_tokenizer, SamplingParams())
    async with ReToolEnv(resources, code_timeout_s=1.0) as env:
        traj = await asyncio.wait_for(runner.run(env, Task(id="t", prompt="1+1?", answer="2")), 120)
    assert traj.turns[0].tool_results[0].status == "TimeLimitExceeded"
    obs = traj.token_ids[traj.turns[0].token_end: traj.turns[0].token_end + traj.turns[0].observation_len]
    assert "TimeoutError" in chat_tokenizer.decode(obs)
    assert all(traj.loss_mask[traj.turns[0].token_end + i] == 0 for i in range(len(obs)))
    assert traj.finish_reason is FinishReason.STOP and traj.reward == 1.0
