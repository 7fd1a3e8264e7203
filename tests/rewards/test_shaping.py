"""Shaping rewards and weighted composition."""

from __future__ import annotations

import math

import pytest

from agentrl.errors import ConfigError
from agentrl.rewards import (
    FormatReward,
    LengthPenalty,
    MathReward,
    MathVerifier,
    RewardInput,
    RewardResult,
    RewardStatus,
    ToolCallPenalty,
    WeightedReward,
)
from agentrl.types import FinishReason, Task, ToolCall, Turn

TASK = Task(id="t", prompt="2+2?", answer="4")


async def constant(task: Task, response: RewardInput, /) -> RewardResult:
    return RewardResult.scored(0.5)


async def broken(task: Task, response: RewardInput, /) -> RewardResult:
    return RewardResult.infra_error("sandbox down")


@pytest.mark.parametrize(
    ("response", "score"),
    [
        (RewardInput(text=r"\boxed{4}"), 1.0),
        (RewardInput(text="four"), 0.5),
        (RewardInput(text=r"\boxed{4}", num_tool_calls=4, num_malformed_tool_calls=1), 0.875),
        (RewardInput(text="four", num_tool_calls=2, num_malformed_tool_calls=2), 0.0),
    ],
)
async def test_format_reward(response: RewardInput, score: float) -> None:
    assert (await FormatReward()(TASK, response)).score == pytest.approx(score)


async def test_tool_call_penalty_is_capped() -> None:
    penalty = ToolCallPenalty(per_call=0.25, cap=0.5)
    assert (await penalty(TASK, RewardInput(text="", num_malformed_tool_calls=1))).score == -0.25
    assert (await penalty(TASK, RewardInput(text="", num_malformed_tool_calls=9))).score == -0.5
    assert (await penalty(TASK, RewardInput(text=""))).score == 0.0


@pytest.mark.parametrize(
    ("tokens", "finish", "score"),
    [
        (100, FinishReason.STOP, 0.0),
        (750, FinishReason.STOP, 0.0),
        (875, FinishReason.STOP, -0.5),
        (1000, FinishReason.STOP, -1.0),
        (1001, FinishReason.STOP, -1.0),
        (10, FinishReason.LENGTH, -1.0),
    ],
)
async def test_length_penalty_is_dapo_soft_overlong(tokens: int, finish: FinishReason, score: float) -> None:
    penalty = LengthPenalty(max_tokens=1000, buffer=250)
    result = await penalty(TASK, RewardInput(text="", response_tokens=tokens, finish_reason=finish))
    assert result.score == pytest.approx(score)


def test_shaping_options_are_checked() -> None:
    for build in (
        lambda: LengthPenalty(max_tokens=0),
        lambda: LengthPenalty(max_tokens=10, buffer=11),
        lambda: ToolCallPenalty(per_call=-1),
        lambda: FormatReward(require_answer=False, check_tool_calls=False),
    ):
        with pytest.raises(ConfigError):
            build()


async def test_weighted_sum_and_breakdown() -> None:
    reward = WeightedReward({"format": (FormatReward(), 0.2), "const": (constant, 2.0)})
    result = await reward(TASK, RewardInput(text=r"\boxed{4}"))
    assert result.ok and result.score == pytest.approx(0.2 * 1.0 + 2.0 * 0.5)
    assert result.details["breakdown"] == {"format": 1.0, "const": 0.5}
    assert result.details["components"]["format"]["answer_present"] == 1.0


async def test_an_infrastructure_failure_voids_the_sum() -> None:
    reward = WeightedReward({"const": (constant, 1.0), "code": (broken, 1.0)})
    result = await reward(TASK, RewardInput(text=""))
    assert result.status is RewardStatus.INFRA_ERROR and math.isnan(result.score)
    assert "code" in result.details["error"]


async def test_weighted_math_format_and_penalty(verifier: MathVerifier) -> None:
    reward = WeightedReward({"math": (MathReward(verifier=verifier), 1.0), "format": (FormatReward(), 0.1),
                             "tool_call_penalty": (ToolCallPenalty(per_call=0.2), 1.0)})
    result = await reward(TASK, RewardInput(text=r"\boxed{4}", num_tool_calls=2, num_malformed_tool_calls=1))
    assert result.ok and result.score == pytest.approx(1.0 + 0.1 * 0.75 - 0.2)
    assert result.details["breakdown"] == {"math": 1.0, "format": 0.75, "tool_call_penalty": -0.2}
    await reward.aclose()  # must not close the caller's verifier
    assert await verifier.verify(r"\boxed{1}", "1") == "equal"


def test_reward_input_from_turns() -> None:
    turns = (
        Turn(
            index=0,
            text="<code>print(1)</code>",
            token_start=10,
            token_end=20,
            tool_calls=(ToolCall("python", {"code": "print(1)"}),),
        ),
        Turn(
            index=1,
            text=r"so \boxed{1}",
            token_start=25,
            token_end=30,
            tool_calls=(ToolCall("python", {}, error="unclosed tag"), ToolCall("python", {})),
        ),
    )
    response = RewardInput.from_turns(turns, FinishReason.STOP)
    assert response == RewardInput(
        text=r"<code>print(1)</code>so \boxed{1}",
        num_tool_calls=3,
        num_malformed_tool_calls=1,
        response_tokens=15,
        finish_reason=FinishReason.STOP,
    )


def test_reward_result_details_are_read_only() -> None:
    result = RewardResult.scored(1.0, verdict="equal")
    with pytest.raises(TypeError):
        result.details["verdict"] = "x"  # type: ignore[index]
