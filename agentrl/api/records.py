"""Typed response bodies of an evaluation's metrics and sample records, for the OpenAPI schema (generated clients
get classes, not ``object``). The definitions are :mod:`agentrl.eval.metrics`, :mod:`agentrl.eval.stats` and
:class:`agentrl.eval.SampleRecord`; these models only describe them. They are lenient on purpose: every field has
a default and unknown keys are kept, so a task stored by an older server still reads (never a 500).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_PASS_AT_K: dict[str, Any] = {"^pass@[0-9]+$": {"anyOf": [{"type": "number"}, {"type": "null"}],
                                "description": "unbiased pass@k averaged over items with >= k ok samples"}}


class Interval(BaseModel):
    """A metric's uncertainty over items: exact Clopper–Pearson for 0/1 item outcomes, else a seeded bootstrap."""

    estimate: float
    stderr: float | None = Field(default=None, description="standard error (None: one item, bootstrap)")
    low: float | None = Field(default=None, description="lower end of the interval")
    high: float | None = None
    method: Literal["clopper-pearson", "bootstrap"]
    n: int = Field(description="items the metric is over")
    level: float = 0.95


class GroupMetrics(BaseModel):
    """The scored metrics of one group of items (``group_by``), with their intervals; ``pass@k`` keys too."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"patternProperties": _PASS_AT_K})

    num_items: int = 0
    num_samples: int = 0
    mean_reward: float | None = None
    accuracy: float | None = None
    intervals: dict[str, Interval | None] = Field(default_factory=dict)


class Metrics(BaseModel):
    """An evaluation's metrics over its ok samples (see agentrl.eval.metrics); ``pass@k`` for each requested k.
    A metric with nothing to average over is null."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"patternProperties": _PASS_AT_K})

    num_items: int = Field(default=0, description="items with at least one ok sample")
    num_samples: int = Field(default=0, description="ok samples")
    num_errors: int = Field(default=0, description="samples whose infrastructure failed (never scored)")
    mean_reward: float | None = None
    accuracy: float | None = Field(default=None, description="fraction of ok samples that are correct")
    mean_turns: float | None = None
    mean_tool_calls: float | None = None
    tool_calls: int = 0
    tool_errors: int = 0
    tool_error_rate: float | None = None
    mean_prompt_tokens: float | None = None
    mean_response_tokens: float | None = None
    mean_model_tokens: float | None = None
    total_tokens: int = 0
    total_model_tokens: int = 0
    finish_reasons: dict[str, int] = Field(default_factory=dict)
    token_level: bool | None = Field(default=None, description="false when any sample ran through chat completions")
    intervals: dict[str, Interval | None] | None = Field(
        default=None, description="mean_reward, accuracy and each pass@k: standard error and 95 % interval")
    groups: dict[str, GroupMetrics] | None = Field(default=None, description="per item group (group_by)")


class SampleRecordBody(BaseModel):
    """One episode of an evaluation (agentrl.eval.SampleRecord)."""

    model_config = ConfigDict(extra="allow")

    item_index: int
    sample_index: int
    task_id: str = Field(description="the item's id")
    status: Literal["ok", "error"]
    reward: float | None = None
    correct: bool | None = None
    reward_breakdown: dict[str, float] = Field(default_factory=dict)
    finish_reason: str | None = None
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    prompt_tokens: int = 0
    response_tokens: int = Field(default=0, description="after the prompt: model and tool-observation tokens")
    model_tokens: int = Field(default=0, description="tokens the model generated")
    duration_s: float = 0.0
    attempts: int = 1
    prompt: str = ""
    answer: str | None = None
    response: str = Field(default="", description="the model's own text, all turns (tool observations left out)")
    error: str | None = None
    trajectory: dict[str, Any] | None = Field(
        default=None, description="agentrl.types.Trajectory: token_ids, loss_mask, behavior_logprobs, "
                                  "weight_versions, turns, …; null with trajectories=false or a chat model")
    token_level: bool = True
    transcript: list[dict[str, Any]] | None = Field(default=None, description="chat messages (a chat model's sample)")
