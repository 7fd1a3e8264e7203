"""A custom environment in one file: unit conversion with a calculator tool (Hermes/Qwen tool calls).

The model may call ``multiply`` with ``<tool_call>{"name": "multiply", "arguments": {"a": 3.5, "b": 1000}}</tool_call>``;
the result comes back in the chat template's ``tool`` role; the final ``\\boxed{}`` answer is checked by the math
reward. Train on it with ``agentrl train examples/custom_env/train.yaml`` (the recipe imports this file).
"""

from __future__ import annotations

import agentrl
from agentrl.env.hermes import ToolCallingEnv
from agentrl.rewards import MathReward, RewardInput, RewardResult


@agentrl.tool
def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


@agentrl.register_env("unit_convert", tools=[multiply])
class UnitConvertEnv(ToolCallingEnv):
    """Unit conversions; a calculator tool; the answer in \\boxed{}."""

    name = "unit_convert"
    tools = (multiply,)
    system_prompt = ("Convert the quantity. You can call the multiply tool. "
                     "Give the final number in \\boxed{}.")

    def __init__(self, resources, **options):
        super().__init__(resources, **options)
        self.reward = MathReward(resources.verifier)

    async def score(self, response: RewardInput) -> RewardResult:
        return await self.reward(self.task, response)
