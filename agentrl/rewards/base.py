"""The reward contract: what an episode runner hands a reward function, and what it gets back.

A reward function is any async callable ``reward(task, response) -> RewardResult``:

- ``task`` is the :class:`agentrl.types.Task` the episode was reset with (``task.answer`` is the math
  reference, ``task.metadata["tests"]`` the code tests);
- ``response`` is a :class:`RewardInput`: the model's text for the whole episode (its turns in order, tool
  observations left out) plus the tool-call and length figures the shaping rewards need.

Two outcomes, kept apart (as SandboxFusion keeps its request status apart from its run status):

- ``RewardStatus.OK``: ``score`` is the reward. The model's mistakes (wrong answer, code that crashes or
  loops, no answer at all) are OK results with a low score.
- ``RewardStatus.INFRA_ERROR``: the reward could not be computed (the sandbox or the checker pool failed).
  ``score`` is NaN: there is no score; the caller retries or drops the sample and never trains on it.

Reward functions raise only :class:`agentrl.errors.ConfigError` (the task lacks what the reward needs, e.g. no
reference answer); infrastructure failures come back as values.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from agentrl.errors import InfrastructureError, RewardError
from agentrl.types import FinishReason, Task, Turn


class RewardStatus(str, enum.Enum):
    OK = "ok"  # score is the reward
    INFRA_ERROR = "infra_error"  # no score: the sandbox or the checker failed; retry or drop the sample


class VerifierError(InfrastructureError):
    """The math checker pool could not check an answer (its workers cannot start or keep dying)."""


@dataclass(frozen=True, slots=True)
class RewardInput:
    """What a reward function sees of an episode besides its task.

    ``text`` is the model's own text, all turns in order, without tool observations (a final answer is the
    last one in it). The counts let shaping rewards score tool use and length without a full trajectory.
    """

    text: str
    num_tool_calls: int = 0
    num_malformed_tool_calls: int = 0
    response_tokens: int = 0
    finish_reason: FinishReason | None = None

    @classmethod
    def from_turns(cls, turns: Sequence[Turn], finish_reason: FinishReason | None = None) -> RewardInput:
        """Build the input from a finished episode's turns (e.g. ``Trajectory.turns``)."""
        calls = [c for t in turns for c in t.tool_calls]
        return cls(
            text="".join(t.text for t in turns),
            num_tool_calls=len(calls),
            num_malformed_tool_calls=sum(1 for c in calls if c.error is not None),
            response_tokens=sum(t.token_end - t.token_start for t in turns),
            finish_reason=finish_reason,
        )


def _frozen(details: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(details or {}))


@dataclass(frozen=True, slots=True)
class RewardResult:
    """A reward: ``score`` when ``status`` is OK; NaN (no score) when it is INFRA_ERROR.

    ``details`` says why (verdict, per-test outcomes, component breakdown); it is read-only.
    """

    score: float
    status: RewardStatus = RewardStatus.OK
    details: Mapping[str, Any] = field(default_factory=lambda: _frozen(None))

    @classmethod
    def scored(cls, score: float, **details: Any) -> RewardResult:
        return cls(float(score), RewardStatus.OK, _frozen(details))

    @classmethod
    def infra_error(cls, message: str, **details: Any) -> RewardResult:
        return cls(math.nan, RewardStatus.INFRA_ERROR, _frozen({"error": message, **details}))

    @property
    def ok(self) -> bool:
        return self.status is RewardStatus.OK

    def raise_for_status(self, episode: str) -> RewardResult:
        """This result if it has a score; else :class:`RewardError` naming ``episode`` (e.g. ``"episode <id>
        (task 'p')"``) and the reason. The one place an INFRA_ERROR value becomes an exception: every episode
        runner calls it, so no trajectory or episode carries a reward that could not be computed."""
        if not self.ok:
            raise RewardError(f"the reward of {episode} could not be computed: "
                              f"{self.details.get('error', 'no reason given')}")
        return self


#: the breakdown component that holds the verifier's verdict (1 right, 0 wrong), in environments that have one
CORRECT_KEY = "correct"


def correctness_score(reward: float, breakdown: Mapping[str, float]) -> float:
    """What correctness is judged on: the breakdown's ``correct`` component (the verifier's verdict, whatever the
    shaping terms add) when it has a finite one, else the total reward."""
    verdict = breakdown.get(CORRECT_KEY)
    return float(verdict) if verdict is not None and math.isfinite(verdict) else float(reward)


def is_correct(reward: float, breakdown: Mapping[str, float], threshold: float = 1.0) -> bool:
    """The one correctness rule (rollout pass rates, mastered prompts, held-out and API evaluations):
    ``correctness_score(reward, breakdown) >= threshold``; the threshold is 1 except where an evaluation sets it."""
    return correctness_score(reward, breakdown) >= threshold


@runtime_checkable
class RewardFn(Protocol):
    """``async (task, response) -> RewardResult``; see the module docstring. A plain async function fits."""

    def __call__(self, task: Task, response: RewardInput, /) -> Awaitable[RewardResult]: ...
