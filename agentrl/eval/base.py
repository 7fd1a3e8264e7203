"""The evaluation contract: one sample record per episode, the result of a whole evaluation, and its errors.

An evaluation runs ``samples_per_item`` episodes of an environment for every item of a dataset and reports
metrics over them. Definitions (used everywhere: metrics, REST, CLI):

- a sample is **ok** when its episode ran and was scored; a sample whose engine, sandbox or reward checker
  failed (after retries) is an **error**: it is recorded with its error and left out of every metric;
- a sample is **correct** by agentrl's one rule (:func:`agentrl.rewards.base.is_correct`, the rule training
  uses too): its *correctness score* is ``>= correct_threshold`` (default 1.0). The correctness score is the
  reward breakdown's ``correct`` component (the verifier's verdict: 1 right, 0 wrong) when the environment
  reports one, else the total reward;
- a sample is **token-level** when its episode ran token-in/token-out on an engine agentrl drives (its
  trajectory holds token ids, logprobs and weight versions); a sample of an ``openai_url`` model ran through
  chat completions and is not (``token_level: false``; its ``transcript`` holds the chat messages instead, and
  its token counts are the server's ``usage``);
- **pass@k** is the unbiased estimator of Chen et al. (2021) per item, averaged over items:
  ``pass@k = 1 - C(n - c, k) / C(n, k)`` with ``n`` ok samples of the item, ``c`` of them correct; items
  with fewer than ``k`` ok samples are left out of pass@k.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from agentrl.errors import ConfigError


class SpecError(ConfigError):
    """A field of an evaluation spec is wrong; ``loc`` names it (e.g. ``("dataset", "path")``)."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc
        self.message = message


class UnknownEnvironmentError(SpecError):
    """The spec names an environment no registry knows; ``known`` lists the registered ones."""

    def __init__(self, name: str, known: tuple[str, ...]) -> None:
        super().__init__(("environment", "name"),
                         f"unknown environment {name!r}; registered environments: {', '.join(known) or 'none'}")
        self.name = name
        self.known = known


def finite(value: float | None) -> float | None:
    """``value``, or None when it is NaN or infinite (JSON has no such numbers)."""
    return value if value is None or math.isfinite(value) else None


@dataclass(frozen=True, slots=True)
class SampleRecord:
    """One episode of an evaluation, as stored and served (``to_dict`` is the REST shape)."""

    item_index: int
    sample_index: int
    task_id: str
    status: Literal["ok", "error"]
    reward: float | None = None
    correct: bool | None = None
    reward_breakdown: dict[str, float] = field(default_factory=dict)
    finish_reason: str | None = None
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0  # malformed calls + calls whose result is not ok (error, timeout, budget, ...)
    prompt_tokens: int = 0
    response_tokens: int = 0  # everything after the prompt: model tokens + tool-observation tokens
    model_tokens: int = 0  # tokens the model generated
    duration_s: float = 0.0
    attempts: int = 1
    prompt: str = ""
    answer: str | None = None
    response: str = ""  # the model's own text, all turns in order (tool observations left out)
    error: str | None = None
    trajectory: dict[str, Any] | None = None  # agentrl.types.Trajectory.to_dict()
    token_level: bool = True  # False: a chat-completions model (no token ids, logprobs or versions anywhere)
    transcript: list[dict[str, Any]] | None = None  # chat messages of a sample that is not token-level

    @property
    def key(self) -> str:
        """Identifies the sample within its evaluation (``"item:sample"``)."""
        return f"{self.item_index}:{self.sample_index}"

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def without_trajectory(self) -> SampleRecord:
        if self.trajectory is None and self.transcript is None:
            return self
        return SampleRecord(**{**self.to_dict(), "trajectory": None, "transcript": None})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SampleRecord:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True, slots=True)
class EvalResult:
    """The outcome of :func:`agentrl.eval.run_eval`: ``status`` is ``succeeded`` or ``cancelled`` (partial)."""

    status: Literal["succeeded", "cancelled"]
    metrics: dict[str, Any]
    records: tuple[SampleRecord, ...]
    total: int  # samples the evaluation asked for (items x samples_per_item)
    wall_time_s: float = 0.0

    @property
    def done(self) -> int:
        return len(self.records)


#: called once per finished sample (ok or error), in completion order
RecordCallback = Callable[[SampleRecord], Awaitable[None]]
