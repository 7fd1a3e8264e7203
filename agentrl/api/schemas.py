"""Response bodies of the evaluation REST API (the request body is :class:`agentrl.eval.EvalSpec`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentrl.api.base import TaskStatus
from agentrl.api.records import Metrics, SampleRecordBody
from agentrl.api.store import TaskRecord

_METRICS_EXAMPLE: dict[str, Any] = {
    "num_items": 1, "num_samples": 4, "num_errors": 0, "mean_reward": 0.5, "accuracy": 0.5, "pass@1": 0.5,
    "pass@4": 1.0, "mean_turns": 1.75, "mean_tool_calls": 0.75, "tool_calls": 3, "tool_errors": 1,
    "tool_error_rate": 0.333, "mean_prompt_tokens": 96.0, "mean_response_tokens": 140.5,
    "mean_model_tokens": 120.25, "total_tokens": 946, "total_model_tokens": 481,
    "finish_reasons": {"stop": 3, "length": 1}, "token_level": True,
    "intervals": {
        "mean_reward": {"estimate": 0.5, "stderr": 0.25, "low": 0.0, "high": 1.0, "method": "bootstrap", "n": 1,
                        "level": 0.95},
        "accuracy": {"estimate": 0.5, "stderr": None, "low": None, "high": None, "method": "bootstrap", "n": 1,
                     "level": 0.95},
        "pass@1": {"estimate": 0.5, "stderr": None, "low": None, "high": None, "method": "bootstrap", "n": 1,
                   "level": 0.95},
        "pass@4": {"estimate": 1.0, "stderr": 0.0, "low": 0.025, "high": 1.0, "method": "clopper-pearson", "n": 1,
                   "level": 0.95}},
}


class Links(BaseModel):
    self: str
    results: str


class Progress(BaseModel):
    done: int = Field(description="samples finished (ok or error)")
    total: int = Field(description="items x samples_per_item")
    errors: int = Field(default=0, description="samples whose infrastructure failed (left out of the metrics)")
    fraction: float = 0.0


class EvalCreated(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "id": "3f2c0b6e9d4a4f7e8a1b2c3d4e5f6a7b", "status": "queued", "progress": {"done": 0, "total": 4},
        "links": {"self": "/v1/evals/3f2c0b6e9d4a4f7e8a1b2c3d4e5f6a7b",
                  "results": "/v1/evals/3f2c0b6e9d4a4f7e8a1b2c3d4e5f6a7b/results"}}]})

    id: str
    status: TaskStatus
    progress: Progress
    links: Links


class DatasetRef(BaseModel):
    """Which content a task ran on (from its stored spec: filled in at submission)."""

    name: str | None = Field(default=None, description="the named dataset, if one")
    version: str | None = None
    path: str | None = Field(default=None, description="the server-side file, if one")
    items: int | None = Field(default=None, description="inline items, if given so")
    sha256: str | None = Field(default=None, description="content hash (see GET /v1/datasets/{name})")

    @classmethod
    def of(cls, spec: dict[str, Any]) -> DatasetRef | None:
        d = spec.get("dataset")
        if not isinstance(d, dict):
            return None
        items = d.get("items")
        return cls(name=d.get("name"), version=d.get("version"), path=d.get("path"), sha256=d.get("sha256"),
                   items=len(items) if isinstance(items, list) else None)


class EvalState(BaseModel):
    """A task: status, progress, metrics (partial while it runs), and the spec it was submitted with."""

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "id": "3f2c0b6e9d4a4f7e8a1b2c3d4e5f6a7b", "name": "smoke", "status": "succeeded",
        "progress": {"done": 4, "total": 4, "errors": 0, "fraction": 1.0}, "metrics": _METRICS_EXAMPLE,
        "error": None, "attempts": 1, "created_at": 1767225600.0, "started_at": 1767225600.5,
        "finished_at": 1767225612.0,
        "links": {"self": "/v1/evals/3f2c0b6e9d4a4f7e8a1b2c3d4e5f6a7b",
                  "results": "/v1/evals/3f2c0b6e9d4a4f7e8a1b2c3d4e5f6a7b/results"}}]})

    id: str
    name: str = ""
    status: TaskStatus
    progress: Progress
    metrics: Metrics | None = Field(default=None, description="see agentrl.eval.metrics; None before any sample")
    error: str | None = None
    attempts: int = 0
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    links: Links
    dataset: DatasetRef | None = Field(default=None, description="the dataset's name, version and sha256")
    spec: dict[str, Any] | None = None
    tenant: str = Field(default="default", description="the tenant that submitted it")
    stored_bytes: int = Field(default=0, description="its stored records, compressed (bounded by the server)")

    @classmethod
    def of(cls, t: TaskRecord, *, with_spec: bool = True) -> EvalState:
        return cls(id=t.id, name=str(t.spec.get("name", "")), status=t.status, progress=progress(t),
                   metrics=_metrics(t.metrics), error=t.error, attempts=t.attempts, created_at=t.created_at,
                   started_at=t.started_at, finished_at=t.finished_at, links=links(t.id),
                   dataset=DatasetRef.of(t.spec), spec=t.spec if with_spec else None, tenant=t.tenant,
                   stored_bytes=t.bytes)


def _metrics(stored: dict[str, Any] | None) -> Metrics | None:
    """Stored metrics as the typed body; metrics this model does not fit (an older server's) go out as stored."""
    if stored is None:
        return None
    try:
        return Metrics.model_validate(stored)
    except ValidationError:
        return Metrics.model_construct(**stored)


class EvalList(BaseModel):
    """A page of tasks, newest first; pass ``next_cursor`` as ``after`` for the next page."""

    evals: list[EvalState]
    has_more: bool = Field(default=False, description="more tasks match after this page")
    next_cursor: str | None = Field(default=None, description="the `after` of the next page (None: last page)")


class ResultsPage(BaseModel):
    """Per-sample records (see agentrl.eval.SampleRecord), in completion order."""

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "id": "3f2c0b6e9d4a4f7e8a1b2c3d4e5f6a7b", "status": "running", "total": 2, "offset": 0, "limit": 100,
        "next_offset": None, "records": [{
            "item_index": 0, "sample_index": 0, "task_id": "item-0", "status": "ok", "reward": 1.0,
            "correct": True, "reward_breakdown": {"correct": 1.0}, "finish_reason": "stop", "num_turns": 2,
            "num_tool_calls": 1, "num_tool_errors": 0, "prompt_tokens": 96, "response_tokens": 60,
            "model_tokens": 48, "duration_s": 1.9, "attempts": 1, "prompt": "What is 17 * 23 + 5?",
            "answer": "396", "response": "<code>print(17*23+5)</code>The answer is \\boxed{396}.", "error": None,
            "trajectory": {"trajectory_id": "3f2c0b6e9d4a-0-0", "prompt_len": 96, "token_ids": [1, 9690, "…"],
                           "loss_mask": [0, 0, "…"], "behavior_logprobs": [0.0, 0.0, "…"],
                           "weight_versions": [-1, -1, "…"], "reward": 1.0, "finish_reason": "stop",
                           "turns": [{"index": 0, "text": "<code>print(17*23+5)</code>", "token_start": 96,
                                      "token_end": 112, "observation_len": 12,
                                      "tool_calls": [{"name": "python", "arguments": {"code": "print(17*23+5)"},
                                                      "raw": "<code>print(17*23+5)</code>", "error": None}],
                                      "tool_results": [{"name": "python", "status": "Finished",
                                                        "output": "396", "latency_s": 0.02}],
                                      "generate_s": 0.4, "tool_s": 0.02}]}}]}]})

    id: str
    status: TaskStatus
    total: int = Field(description="records stored so far")
    offset: int
    limit: int
    next_offset: int | None = Field(description="offset of the next page; None when this page is the last so far")
    records: list[SampleRecordBody]


class ToolInfo(BaseModel):
    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict)


class EnvironmentInfo(BaseModel):
    name: str
    description: str = ""
    tools: list[ToolInfo]
    stop: list[str] = Field(default_factory=list, description="strings that end a model turn for a tool call")


class EnvironmentList(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"environments": [{
        "name": "retool", "description": "Math with a Python code interpreter (ReTool).", "tools": [],
        "stop": ["</code>"]}]}]})

    environments: list[EnvironmentInfo]


class Health(BaseModel):
    """Liveness only (no token needed): what the service runs is in ``GET /v1/status`` (admin)."""

    status: str = Field(description="ok, or degraded when Redis does not answer")
    redis: bool


class ServiceStatus(BaseModel):
    """What the service holds and runs (admin only)."""

    redis: bool
    queued: int | None = Field(default=None, description="tasks waiting in the queue")
    tasks: dict[str, int] = Field(default_factory=dict, description="stored tasks per status, all tenants")
    running: list[str] = Field(default_factory=list, description="tasks this process runs now")
    engines: list[dict[str, Any]] = Field(default_factory=list)
    worker: str = ""
    stored_bytes: int | None = Field(default=None, description="datasets + compressed records of all tasks")
    max_store_bytes: int = Field(description="at this bound new tasks get 507")
    tenants: list[str] = Field(default_factory=list, description="configured tenant names")


class ErrorBody(BaseModel):
    detail: Any = Field(description="a message, or a list of field errors {loc, msg, type}")


def links(task_id: str) -> Links:
    return Links(self=f"/v1/evals/{task_id}", results=f"/v1/evals/{task_id}/results")


def progress(t: TaskRecord) -> Progress:
    return Progress(done=t.done, total=t.total, errors=t.errors,
                    fraction=round(t.done / t.total, 4) if t.total else 0.0)


class Comparison(BaseModel):
    """Run ``b`` against run ``a`` over the items both scored (see agentrl.eval.stats)."""

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "a": "3f2c0b6e9d4a4f7e8a1b2c3d4e5f6a7b", "b": "9a8b7c6d5e4f40312a1b2c3d4e5f6a7b", "metric": "accuracy",
        "status_a": "succeeded", "status_b": "succeeded", "n": 40, "only_a": 0, "only_b": 0, "mean_a": 0.45,
        "mean_b": 0.625, "difference": 0.175, "stderr": 0.068, "low": 0.05, "high": 0.3, "level": 0.95,
        "p_value": 0.0386, "test": "mcnemar-exact", "interval_method": "paired-bootstrap", "discordant": [10, 3],
        "significant": True}]})

    a: str
    b: str
    metric: str = Field(description="accuracy, mean_reward or pass@K; per item over its ok samples")
    status_a: TaskStatus
    status_b: TaskStatus
    n: int = Field(description="items both runs scored (the pairs)")
    only_a: int = Field(description="items only run a scored (left out)")
    only_b: int = Field(description="items only run b scored (left out)")
    mean_a: float
    mean_b: float
    difference: float = Field(description="mean_b - mean_a over the paired items")
    stderr: float | None = Field(description="standard error of the difference (None for one pair)")
    low: float | None = Field(description="lower end of the interval of the difference (paired bootstrap)")
    high: float | None
    level: float = 0.95
    p_value: float = Field(description="two-sided, of no difference")
    test: str = Field(description="mcnemar-exact (0/1 item outcomes) or paired-permutation")
    interval_method: str = "paired-bootstrap"
    discordant: list[int] | None = Field(default=None, description="McNemar: items [b better, a better]")
    significant: bool = Field(description="p_value < 1 - level")


class DatasetVersionInfo(BaseModel):
    version: str
    source: str = Field(description="file (under a dataset root), plugin (agentrl.datasets) or builtin (a generator)")
    sha256: str | None = Field(description="content hash (None for a generator: it depends on n and seed)")
    size_bytes: int | None = Field(default=None, description="a file's size")


class DatasetInfo(BaseModel):
    """A named dataset: use it as ``dataset: {name, version?}`` in a spec."""

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "name": "gsm8k-mini", "description": "200 grade-school problems", "latest": "v2", "versions": [
            {"version": "v1", "source": "file", "size_bytes": 51234,
             "sha256": "9f2b5c0e6d4a4f7e8a1b2c3d4e5f6a7b9f2b5c0e6d4a4f7e8a1b2c3d4e5f6a7b"},
            {"version": "v2", "source": "file", "size_bytes": 52001,
             "sha256": "0c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f60c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5"}]}]})

    name: str
    description: str = ""
    latest: str = Field(description="the version a spec without one gets")
    versions: list[DatasetVersionInfo]


class DatasetList(BaseModel):
    datasets: list[DatasetInfo]
