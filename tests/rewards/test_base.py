"""The one correctness rule (rollout pass rates, mastered prompts, held-out and API evaluations)."""

from __future__ import annotations

import math

import pytest

from agentrl.errors import RewardError
from agentrl.rewards.base import RewardResult, RewardStatus, correctness_score, is_correct


def test_correctness_uses_the_correct_component_when_there_is_one() -> None:
    assert correctness_score(0.3, {"correct": 1.0, "format": -0.7}) == 1.0
    assert correctness_score(0.75, {"tests": 0.75}) == 0.75
    assert is_correct(1.1, {"correct": 1.0, "format": 0.1}) and not is_correct(1.0, {"correct": 0.0, "format": 1.0})
    assert is_correct(1.0, {}) and not is_correct(0.5, {})


def test_the_threshold_is_one_unless_given() -> None:
    assert not is_correct(0.75, {"tests": 0.75}) and is_correct(0.75, {"tests": 0.75}, threshold=0.7)


def test_a_verdict_that_is_not_a_number_is_no_verdict() -> None:
    assert correctness_score(0.2, {"correct": math.nan}) == 0.2
    assert not is_correct(math.nan, {})


def test_a_reward_without_a_score_raises_reward_error_naming_the_episode_and_the_reason() -> None:
    ok = RewardResult.scored(0.5)
    assert ok.raise_for_status("episode t1") is ok
    with pytest.raises(RewardError, match=r"episode t1 \(task 'p'\) could not be computed: sandbox down"):
        RewardResult.infra_error("sandbox down").raise_for_status("episode t1 (task 'p')")
    with pytest.raises(RewardError, match="no reason given"):
        RewardResult(math.nan, RewardStatus.INFRA_ERROR).raise_for_status("episode t2")
