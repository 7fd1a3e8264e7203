"""``math``: a math problem answered in one turn, no tools; the final ``\\boxed{}`` answer is checked against
``task.answer`` by :class:`agentrl.rewards.MathReward` through the process's shared checker pool
(``EnvResources.verifier``). Optional ``format_weight`` adds :class:`agentrl.rewards.FormatReward`.
"""

from __future__ import annotations

from agentrl.env.base import SingleTurnEnv
from agentrl.env.registry import EnvResources
from agentrl.errors import ConfigError
from agentrl.rewards import FormatReward, MathReward, RewardFn, WeightedReward
from agentrl.types import Task

SYSTEM_PROMPT = "Solve the math problem. Reason step by step, then put the final answer in \\boxed{}."


class MathEnv(SingleTurnEnv):
    """Math without tools: one model turn, reward 1 if its last ``\\boxed{}`` equals the reference answer."""

    name = "math"

    def __init__(self, resources: EnvResources, *, system_prompt: str = SYSTEM_PROMPT,
                 format_weight: float = 0.0) -> None:
        if resources.verifier is None:
            raise ConfigError("the math environment needs a math checker pool (EnvResources.verifier)")
        self.system_prompt = system_prompt
        components: dict[str, tuple[RewardFn, float]] = {"correct": (MathReward(resources.verifier), 1.0)}
        if format_weight:
            components["format"] = (FormatReward(check_tool_calls=False), format_weight)
        self.reward = WeightedReward(components)

    def validate(self, task: Task) -> None:
        if task.answer is None:
            raise ConfigError(f"task {task.id!r} has no reference answer; the math environment needs Task.answer")
