"""Rule-based rewards: verified math answers, code tests in the sandbox, format and tool-use shaping.

A reward is ``async (task, RewardInput) -> RewardResult``; see :mod:`agentrl.rewards.base` for the contract
(score vs INFRA_ERROR). An environment builds its rewards and composes them with :class:`WeightedReward`.

The public names load on first use (``agentrl._lazy``), so a run's configuration reads :class:`RewardsConfig`
without the rewards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentrl._lazy import lazy_exports

if TYPE_CHECKING:
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
        find_program,
        outputs_match,
        parse_tests,
        returns_match,
    )
    from agentrl.rewards.config import RewardsConfig
    from agentrl.rewards.math import MathReward, Verdict, check_answer, extract_answer, is_equivalent
    from agentrl.rewards.shaping import FormatReward, LengthPenalty, ToolCallPenalty, WeightedReward
    from agentrl.rewards.verifier import MathVerifier

_HOME = {
    **dict.fromkeys(["CORRECT_KEY", "RewardFn", "RewardInput", "RewardResult", "RewardStatus", "VerifierError",
                     "correctness_score", "is_correct"], "base"),
    **dict.fromkeys(["CodeTestsReward", "TestCase", "TestOutcome", "TestReport", "TestStatus", "extract_program",
                     "find_program", "outputs_match", "parse_tests", "returns_match"], "code"),
    "RewardsConfig": "config",
    **dict.fromkeys(["MathReward", "Verdict", "check_answer", "extract_answer", "is_equivalent"], "math"),
    **dict.fromkeys(["FormatReward", "LengthPenalty", "ToolCallPenalty", "WeightedReward"], "shaping"),
    "MathVerifier": "verifier",
}

__all__ = [
    "CORRECT_KEY",
    "CodeTestsReward",
    "FormatReward",
    "LengthPenalty",
    "MathReward",
    "MathVerifier",
    "RewardsConfig",
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
    "find_program",
    "is_correct",
    "is_equivalent",
    "outputs_match",
    "parse_tests",
    "returns_match",
]

__getattr__, __dir__ = lazy_exports(__name__, _HOME)
