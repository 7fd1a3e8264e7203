"""The run configuration: one YAML per run, ``key=value`` overrides, one section per component.

Each component's constructor gets only its own section. The resolved configuration is saved as
``runs/<name>/config.yaml``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agentrl.errors import ConfigError, closest
from agentrl.launcher.trackers import TrackioSection, WandbSection
from agentrl.overrides import merge, parse_overrides, read_mapping

__all__ = ["RunConfig", "describe_errors", "load_config", "parse_overrides", "save_config"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineSection(_Section):
    """The SGLang server(s). ``url``: use a running server instead of starting one."""

    url: str | None = None  # one URL, or several separated by commas (a pool of running servers)
    num_servers: int = Field(1, ge=1)  # servers to start (sticky routing, crash restart with weight resync)
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: str = "auto"  # auto: float32, or bfloat16 where this CPU/GPU multiplies bf16 fast (agentrl.hardware)
    max_total_tokens: int | None = 16384
    context_length: int | None = None
    tp_size: int = 1
    python: str | None = None  # interpreter of the SGLang environment (default: this one)
    startup_timeout_s: float = 300.0
    extra_args: list[str] = Field(default_factory=list)
    record_requests: bool = False  # debug: every generate call → runs/<name>/engine_requests.jsonl


class RedisSection(_Section):
    url: str | None = None  # external Redis; default: AGENTRL_REDIS_URL, else an embedded server in the run dir


class SandboxSection(_Section):
    backend: Literal["local", "docker", "remote"] = "local"
    url: str | None = None  # for backend "remote"
    max_concurrency: int = 8
    options: dict[str, Any] = Field(default_factory=dict)


class EnvSection(_Section):
    name: str = "retool"
    options: dict[str, Any] = Field(default_factory=dict)


class DataSection(_Section):
    """``train`` / ``heldout``: a problem family of agentrl.data.arithmetic, or a dataset (.jsonl, .json, .parquet,
    .arrow, a save_to_disk folder; see agentrl.data.loader) whose rows hold ``prompt_key`` (a string or chat
    messages) and ``answer_key`` (null: no answers); keys may be dotted paths into nested columns."""

    train: str = "rl"
    heldout: str = "heldout"
    num_heldout: int = 0  # held-out problems evaluated before and after training (0: skip)
    prompt_key: str = Field("prompt", min_length=1)
    answer_key: str | None = Field("answer", min_length=1)  # e.g. reward_model.ground_truth (verl's layout)


class RolloutSection(_Section):
    n_samples: int = Field(2, ge=1)  # episodes per prompt (GRPO group)
    groups_per_step: int = Field(4, ge=1)  # prompts per trainer step
    max_staleness: int = Field(0, ge=0)  # η; 0 = synchronous
    max_running_groups: int = Field(8, ge=1)
    update_mode: Literal["drain", "interrupt", "abort_restart"] = "interrupt"
    pause_mode: Literal["abort", "retract", "in_place"] = "retract"  # how update_mode "interrupt" pauses SGLang
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(128, ge=1)  # per model turn
    max_turns: int = Field(4, ge=1)
    max_response_tokens: int = Field(512, ge=1)
    max_context_tokens: int = Field(2048, ge=16)
    drop_uniform_groups: bool = False
    max_dropped_per_queued: float | None = Field(None, ge=0)  # budget of drop_uniform_groups (None: no limit)
    # skip prompts (or generated wordings) the policy has mastered: pass rate >= skip_solved_rate over their last
    # skip_solved_window groups; a skip_solved_keep fraction of them still runs, to recheck (0 = off)
    skip_solved_window: int = Field(0, ge=0)
    skip_solved_rate: float = Field(1.0, gt=0, le=1)
    skip_solved_keep: float = Field(0.25, gt=0, le=1)


class SFTSection(_Section):
    """Cold-start SFT on ReTool-style traces before RL (the trainer's SFT mode)."""

    enabled: bool = True
    data: str | None = None  # a dataset of conversations (messages_key) or {token_ids, loss_mask} rows (agentrl.data.sft)
    messages_key: str = Field("messages", min_length=1)
    max_tokens: int | None = Field(None, ge=2)  # longer traces are cut (and counted); null: rollout.max_context_tokens
    family: str = "sft"  # without `data`: generated arithmetic traces of this family
    num_traces: int = Field(256, ge=1)
    steps: int = Field(40, ge=0)
    batch_size: int = Field(16, ge=1)
    lr: float = Field(1e-3, gt=0)


class ResourcesSection(_Section):
    """Where the parts run. A local Ray cluster by default (no dashboard, no auth token files); ``ray_address``
    joins an existing cluster. ``*_cores`` pin processes to CPU cores (each side gets its own, as on a cluster)."""

    ray_address: str | None = None
    trainer_world_size: int = Field(1, ge=1)
    trainer_num_cpus: float = Field(1.0, gt=0)
    trainer_num_gpus: float = Field(0.0, ge=0)
    rollout_num_cpus: float = Field(1.0, gt=0)
    rollout_cores: list[int] | None = None
    trainer_cores: list[int] | None = None
    max_trainer_restarts: int = Field(2, ge=0)


class MonitorSection(_Section):
    """Live progress (rich, on a terminal), Prometheus ``/metrics`` on 127.0.0.1 (port 0: any free port; null:
    off), TensorBoard event files in ``runs/<name>/tensorboard``, and optionally W&B / trackio
    (:mod:`agentrl.launcher.trackers`)."""

    live: bool = True
    prometheus_port: int | None = 0
    tensorboard: bool = True
    interval_s: float = Field(2.0, gt=0)
    wandb: WandbSection | None = None  # Weights & Biases (pip install 'agentrl[wandb]'); null: off
    trackio: TrackioSection | None = None  # trackio, local unless space_id; null: off


class RunConfig(_Section):
    name: str = ""
    imports: list[str] = Field(default_factory=list)  # modules or .py files to import first (they register envs)
    runs_dir: str = "runs"
    seed: int = 0
    model: str = "tiny"
    steps: int = Field(2, ge=1)  # RL steps; the final weight version equals this
    checkpoint_every: int = Field(1, ge=1)
    keep_checkpoints: int = Field(2, ge=1)  # older ones are deleted (a 135M checkpoint with Adam state is ~1.7 GB)
    keep_weight_versions: int | None = Field(4, ge=2)  # published versions kept besides v0 (null: all)
    log_rollouts: Literal["none", "summary", "full"] = "summary"  # runs/<name>/rollouts.jsonl
    engine: EngineSection = Field(default_factory=EngineSection)
    redis: RedisSection = Field(default_factory=RedisSection)
    sandbox: SandboxSection = Field(default_factory=SandboxSection)
    env: EnvSection = Field(default_factory=EnvSection)
    data: DataSection = Field(default_factory=DataSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    sft: SFTSection = Field(default_factory=SFTSection)
    trainer: dict[str, Any] = Field(default_factory=dict)  # agentrl.trainer.TrainerConfig minus `model`
    resources: ResourcesSection = Field(default_factory=ResourcesSection)
    monitor: MonitorSection = Field(default_factory=MonitorSection)

    @field_validator("trainer")
    @classmethod
    def _trainer_section_is_valid(cls, value: dict[str, Any]) -> dict[str, Any]:
        from agentrl.trainer.config import TrainerConfig

        if "model" in value:
            raise ValueError("set the model at the top level (`model:`), not in the trainer section")
        TrainerConfig(model="-", **value)
        return value

    @model_validator(mode="after")
    def _trainer_scores_at_the_sampling_temperature(self) -> RunConfig:
        """The trainer's log-probs must be those of the distribution the engine sampled from (logits / T), or
        every importance ratio is off by the temperature: ``trainer.loss.temperature`` follows
        ``rollout.temperature`` unless set, and may not contradict it (greedy sampling, T = 0, leaves it alone)."""
        sampled = self.rollout.temperature
        loss = self.trainer.get("loss", {})
        if sampled <= 0:
            return self
        if "temperature" not in loss:
            if sampled != 1.0:
                self.trainer = {**self.trainer, "loss": {**loss, "temperature": sampled}}
        elif float(loss["temperature"]) != sampled:
            raise ValueError(f"trainer.loss.temperature {loss['temperature']} differs from rollout.temperature "
                             f"{sampled}: the trainer must score tokens at the temperature they were sampled at "
                             "(leave trainer.loss.temperature unset to follow the rollout's)")
        return self

    def with_absolute_paths(self) -> RunConfig:
        """Relative file paths (imports, datasets, runs_dir) made absolute against the current directory, so
        processes started elsewhere (Ray workers) see the same files."""
        def absolute(value: str) -> str:
            p = Path(value)
            file_like = p.suffix in (".py", ".jsonl", ".json", ".parquet", ".arrow") or p.exists()
            return str(p.resolve()) if not p.is_absolute() and file_like else value

        data = self.data.model_copy(update={"train": absolute(self.data.train),
                                            "heldout": absolute(self.data.heldout)})
        sft = self.sft.model_copy(update={"data": absolute(self.sft.data) if self.sft.data else None})
        return self.model_copy(update={"imports": [absolute(i) for i in self.imports], "data": data, "sft": sft,
                                       "runs_dir": str(Path(self.runs_dir).resolve())})

    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.name

    def with_default_name(self, prefix: str = "run") -> RunConfig:
        if self.name:
            return self
        return self.model_copy(update={"name": f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"})


def load_config(path: str | Path | None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None) -> RunConfig:
    """Read a YAML run config (or start from ``base``), apply overrides, validate."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        data = merge(data, read_mapping(Path(path)))
    data = merge(data, parse_overrides(overrides or []))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError("invalid run configuration:\n" + describe_errors(exc, RunConfig)) from None


def _section_model(cls: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model that holds the key at ``loc`` (``trainer`` is a dict checked as a TrainerConfig)."""
    from agentrl.trainer.config import TrainerConfig

    for part in loc:
        if cls is RunConfig and part == "trainer":
            cls = TrainerConfig
            continue
        field = cls.model_fields.get(str(part))
        if field is None:
            return None
        candidates = [field.annotation, *getattr(field.annotation, "__args__", ())]
        models = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not models:
            return None
        cls = models[0]
    return cls


def describe_errors(exc: ValidationError, root: type[BaseModel]) -> str:
    """One line per error, ``dotted.key: what is wrong``; an unknown key names the closest known one."""
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in loc)
        if err["type"] == "extra_forbidden":
            holder = _section_model(root, loc[:-1])
            known = sorted(holder.model_fields) if holder is not None else []
            close = closest(str(loc[-1]), known)
            hint = f" (did you mean {'.'.join([*map(str, loc[:-1]), close])!r}?)" if close else ""
            lines.append(f"  {key}: unknown key{hint}; known keys here: {', '.join(known) or '?'}")
        else:
            lines.append(f"  {key or '(top level)'}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


def save_config(config: RunConfig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
