"""Rule-based rewards: verified math answers, code tests in the sandbox, format and tool-use shaping.

A reward is ``async (task, RewardInput) -> RewardResult``; see :mod:`agentrl.rewards.base` for the contract
(score vs INFRA_ERROR). An environment builds its rewards and composes them with :class:`WeightedReward`.
"""

from agentrl.rewards.base import (
    CORRECT_KEY,
    RewardFn,
    RewardInput,
    RewardResult,
    RewardStatus,
    VerifierError,
    correctness_score,
    is_correct,
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
from agentrl.rewards.shaping import FormatReward, LengthPenalty, ToolCallPenalty, WeightedReward
from agentrl.rewards.verifier import MathVerifier

__all__ = [
    "CORRECT_KEY",
    "CodeTestsReward",
    "FormatReward",
    "LengthPenalty",
    "MathReward",
    "MathVerifier",
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
    "check_answer",
    "correctness_score",
    "extract_answer",
    "extract_program",
    "is_correct",
    "is_equivalent",
    "outputs_match",
    "parse_tests",
]
