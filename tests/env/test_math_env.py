"""The built-in ``math`` environment with the REAL math checker pool: one turn, no tools, \\boxed{} answers."""

from __future__ import annotations

import pytest
from env_support import ScriptedEngine

from agentrl.async_rollout import EpisodeRunner
from agentrl.engine.base import SamplingParams
from agentrl.env import default_registry
from agentrl.env.math import MathEnv
from agentrl.errors import ConfigError
from agentrl.rewards import RewardInput
from agentrl.types import FinishReason, Task


async def test_registered_and_one_turn(env_resources):
    env = default_registry.make_env("math", env_resources)
    assert isinstance(env, MathEnv) and env.tool_schemas() == []
    messages = await env.reset(Task(id="m", prompt="What is 2+2?", answer="4"))
    assert messages[-1] == {"role": "user", "content": "What is 2+2?"} and messages[0]["role"] == "system"
    assert (await env.step("It is \\boxed{4}.")).done


@pytest.mark.parametrize("text, score", [
    ("2+2 is \\boxed{4}.", 1.0),
    ("\\boxed{4.0}", 1.0),
    ("I think \\boxed{5}.", 0.0),
    ("four", 0.0),  # no final answer
    ("\\boxed{5} no wait \\boxed{4}", 1.0),  # the last one counts
])
async def test_reward(env_resources, text, score):
    env = MathEnv(env_resources)
    await env.reset(Task(id="m", prompt="2+2?", answer="4"))
    result = await env.score(RewardInput(text=text))
    assert result.ok and result.score == score


async def test_format_weight_adds_the_format_component(env_resources):
    env = MathEnv(env_resources, format_weight=0.5)
    await env.reset(Task(id="m", prompt="2+2?", answer="4"))
    result = await env.score(RewardInput(text="\\boxed{3}"))
    assert result.score == 0.5 and result.details["breakdown"] == {"correct": 0.0, "format": 1.0}


async def test_needs_an_answer_and_a_checker(env_resources):
    with pytest.raises(ConfigError, match="needs Task.answer"):
        await MathEnv(env_resources).reset(Task(id="m", prompt="?"))
    with pytest.raises(ConfigError, match="verifier"):
        MathEnv(type(env_resources)())


async def test_episode(env_resources, chat_tokenizer):
    engine = ScriptedEngine(chat_tokenizer, [("2 plus 2 is \\boxed{4}.", True)])
    runner = EpisodeRunner(engine, chat_tokenizer, SamplingParams(max_new_tokens=64))
    async with MathEnv(env_resources) as env:
        traj = await runner.run(env, Task(id="m", prompt="2+2?", answer="4"), env_name="math")
    assert traj.reward == 1.0 and traj.finish_reason is FinishReason.STOP and len(traj.turns) == 1
    assert traj.token_ids.tolist() == engine.requests[0] + engine.outputs[0]
    assert traj.reward_breakdown == {"correct": 1.0}
