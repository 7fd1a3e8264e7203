"""Rule-based rewards: verified math answers, code tests in the sandbox, format and tool-use shaping.

A reward is ``async (task, RewardInput) -> RewardResult``; see :mod:`agentrl.rewards.base` for the contract
(score vs INFRA_ERROR) and :mod:`agentrl.rewards.registry` for names and composition.
"""

from agentrl.rewards.base import (
    RewardFactory,
    RewardFn,
    RewardInput,
    RewardResult,
    RewardStatus,
    VerifierError,
)
from agentrl.rewards.code import (
    CodeTestsReward,
    TestCase,
    TestOutcome,
    TestReport,
    TestStatus,
    extract_program,
    outputs_match,
    parse_tests,
)
from agentrl.rewards.math import MathReward, Verdict, check_answer, extract_answer, is_equivalent
from agentrl.rewards.registry import REWARDS, builtin_rewards, combine, get_reward, register_reward
from agentrl.rewards.shaping import FormatReward, LengthPenalty, ToolCallPenalty, WeightedReward
from agentrl.rewards.verifier import MathVerifier

__all__ = [
    "REWARDS",
    "CodeTestsReward",
    "FormatReward",
    "LengthPenalty",
    "MathReward",
    "MathVerifier",
    "RewardFactory",
    "RewardFn",
    "RewardInput",
    "RewardResult",
    "RewardStatus",
    "TestCase",
    "TestOutcome",
    "TestReport",
    "TestStatus",
    "ToolCallPenalty",
    "Verdict",
    "VerifierError",
    "WeightedReward",
    "builtin_rewards",
    "check_answer",
    "combine",
    "extract_answer",
    "extract_program",
    "get_reward",
    "is_equivalent",
    "outputs_match",
    "parse_tests",
    "register_reward",
]
