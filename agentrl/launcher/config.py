"""The run configuration: one YAML per run, ``key=value`` overrides, one section per component.

Each component's constructor gets only its own section. The resolved configuration is saved as
``runs/<name>/config.yaml``.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import urlparse

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from agentrl.async_rollout.config import EpisodeBudget, RolloutConfig
from agentrl.engine.base import SamplingParams
from agentrl.engine.config import PoolConfig, Timeouts
from agentrl.engine.server import SGLangServerConfig
from agentrl.errors import ConfigError, closest
from agentrl.gateway.config import GatewayConfig
from agentrl.launcher.trackers import TrackioSection, WandbSection
from agentrl.overrides import merge, parse_overrides, read_mapping
from agentrl.rewards.config import RewardsConfig
from agentrl.sandbox.config import SandboxConfig
from agentrl.trainer.config import TrainerSettings, WeightSyncSettings

__all__ = ["RunConfig", "config_keys", "describe_errors", "load_config", "parse_overrides", "save_config"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Composed(_Section):
    """A section that composes component configs (its ``PARTS``): in YAML one flat mapping of their fields and its
    own (``rollout.temperature``), in code one typed object per component (``cfg.rollout.sampling``), handed to
    that component's constructor as is. Every key has one owner, the component's class; the part's default here
    (``scheduler: RolloutConfig = RolloutConfig()``) is the run's default for every key of it a YAML leaves out."""

    PARTS: ClassVar[tuple[str, ...]] = ()
    HIDDEN: ClassVar[frozenset[str]] = frozenset()  # part fields the run sets itself (not YAML keys)

    @classmethod
    def part_type(cls, part: str) -> type:
        kind = cls.model_fields[part].annotation
        assert isinstance(kind, type), f"{cls.__name__}.{part} must be annotated with a class"
        return kind

    @classmethod
    def part_keys(cls, part: str) -> list[str]:
        return [k for k in _field_names(cls.part_type(part)) if k not in cls.HIDDEN]

    @classmethod
    def yaml_keys(cls) -> list[str]:
        own = [k for k in cls.model_fields if k not in cls.PARTS]
        return own + [k for part in cls.PARTS for k in cls.part_keys(part)]

    @model_validator(mode="before")
    @classmethod
    def _route_flat_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for part in cls.PARTS:
            base = data.pop(part, None)
            if base is None:
                base = cls.model_fields[part].get_default(call_default_factory=True)
            elif not isinstance(base, cls.part_type(part)):  # a typed object, from Python only
                raise ValueError(f"unknown key {part!r}: its keys ({', '.join(cls.part_keys(part))}) are written "
                                 "directly in this section")
            given = {k: data.pop(k) for k in cls.part_keys(part) if k in data}
            data[part] = {**_field_values(base), **given}
        return data

    @model_serializer(mode="wrap")
    def _flatten(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        own: dict[str, Any] = handler(self)
        flat = {k: v for part in self.PARTS for k, v in own.pop(part).items() if k not in self.HIDDEN}
        return {**flat, **own}


def _field_names(cls: Any) -> list[str]:
    return list(cls.model_fields) if issubclass(cls, BaseModel) else [f.name for f in dataclasses.fields(cls)]


def _field_values(obj: Any) -> dict[str, Any]:
    return dict(obj) if isinstance(obj, BaseModel) else {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


class EngineSection(_Composed):
    """The SGLang server(s): how to start each (``server``: every SGLangServerConfig key but ``model_path``, which
    is the run's ``model``), or ``url`` of running ones; how the pool watches and restarts them (``pool``:
    :class:`PoolConfig`) and each client's deadlines (``timeouts``: :class:`Timeouts`)."""

    PARTS = ("server", "pool", "timeouts")
    HIDDEN = frozenset({"model_path"})

    url: str | None = None  # one URL, or several separated by commas (a pool of running servers)
    num_servers: int = Field(default=1, ge=1)  # servers to start (sticky routing, crash restart with weight resync)
    record_requests: bool = False  # debug: every generate call → runs/<name>/engine_requests.jsonl
    # an sglang-router in front of the servers: generation takes its policy's route (cache_aware: where the prefix
    # is cached), control goes to each server; off: the pool's own sticky routing (an episode on one server)
    router: bool = False
    router_policy: Literal["cache_aware", "round_robin", "random", "power_of_two"] = "cache_aware"
    server: SGLangServerConfig = SGLangServerConfig()
    pool: PoolConfig = PoolConfig()
    timeouts: Timeouts = Timeouts()

    @property
    def urls(self) -> list[str]:
        """The running servers ``url`` names, empty entries skipped ([] when the run starts its own)."""
        return [u for u in (s.strip() for s in (self.url or "").split(",")) if u]


class GatewaySection(_Composed):
    """The agent gateway of agent environments (:class:`agentrl.gateway.GatewayConfig`). Three of its settings
    have other owners in a run: ``model_name`` is the run's ``model``, ``tool_parser`` the agent environment's
    option (``env.options.tool_parser``), and each session continues aborted generations ``rollout.max_resumes``
    times (its :class:`~agentrl.gateway.SessionLimits`, built from the episode budget and sampling)."""

    PARTS = ("config",)
    HIDDEN = frozenset({"model_name", "tool_parser", "max_resumes"})

    config: GatewayConfig = GatewayConfig()


class RedisSection(_Section):
    url: str | None = None  # external Redis; default: AGENTRL_REDIS_URL, else an embedded server in the run dir


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
    # also evaluate them during RL each time the served weight version reaches a multiple of this (0: only before,
    # after SFT and after RL): summary.json's heldout_curve and time to accuracy (launcher/heldout_curve.py)
    heldout_every: int = Field(default=0, ge=0)
    prompt_key: str = Field(default="prompt", min_length=1)
    answer_key: str | None = Field(default="answer", min_length=1)  # e.g. reward_model.ground_truth (verl's layout)

    @model_validator(mode="after")
    def _heldout_every_needs_heldout_problems(self) -> DataSection:
        if self.heldout_every > 0 and self.num_heldout == 0:
            raise ValueError(f"data.heldout_every: {self.heldout_every} evaluates the held-out problems during RL, "
                             "but data.num_heldout is 0 (none): set data.num_heldout (e.g. 40), or heldout_every: 0")
        return self


class RolloutSection(_Composed):
    """The rollout process: the scheduler (:class:`RolloutConfig`, whose defaults are the run's), the engine's
    sampling (:class:`SamplingParams`) and each episode's budget (:class:`EpisodeBudget`), plus skip-solved."""

    PARTS = ("scheduler", "sampling", "budget")

    scheduler: RolloutConfig = RolloutConfig()
    # the run's defaults (CPU-sized turns and episodes) win over these classes' own for every key a YAML leaves out
    sampling: SamplingParams = SamplingParams(max_new_tokens=128)
    budget: EpisodeBudget = EpisodeBudget(max_turns=4, max_response_tokens=512, max_context_tokens=2048)
    # skip prompts (or generated wordings) the policy has mastered: pass rate >= skip_solved_rate over their last
    # skip_solved_window groups; a skip_solved_keep fraction of them still runs, to recheck (0 = off)
    skip_solved_window: int = Field(default=0, ge=0)
    skip_solved_rate: float = Field(default=1.0, gt=0, le=1)
    skip_solved_keep: float = Field(default=0.25, gt=0, le=1)


class SFTSection(_Section):
    """Cold-start SFT on ReTool-style traces before RL (the trainer's SFT mode)."""

    enabled: bool = True
    data: str | None = None  # a dataset of conversations (messages_key) or {token_ids, loss_mask} rows (agentrl.data.sft)
    messages_key: str = Field(default="messages", min_length=1)
    max_tokens: int | None = Field(default=None, ge=2)  # longer traces are cut (and counted); null: rollout.max_context_tokens
    family: str = "sft"  # without `data`: generated arithmetic traces of this family
    num_traces: int = Field(default=256, ge=1)
    steps: int = Field(default=40, ge=0)
    batch_size: int = Field(default=16, ge=1)
    lr: float = Field(default=1e-3, gt=0)


def borrowing_obstacle(r: ResourcesSection, *, trainer_on_gpu: bool = False, same_host: bool = True) -> str | None:
    """What keeps the trainer from borrowing the rollout side's idle cores (None: nothing). ``same_host``: also
    what could put the two sides on different nodes (``auto`` avoids it; ``true`` trusts the user, and the
    trainer checks the rollout side's host name anyway)."""
    if r.placement == "colocated":
        return "split placement (colocated gives the trainer every core already)"
    if not r.ray:
        return "Ray (debug mode runs one process, nothing pinned)"
    if not r.rollout_cores or not r.trainer_cores or set(r.rollout_cores) & set(r.trainer_cores):
        return "resources.rollout_cores and trainer_cores, both given and disjoint"
    if r.trainer_world_size != 1:
        return "one trainer rank (trainer_world_size 1)"
    if trainer_on_gpu or r.trainer_num_gpus > 0:
        return "a CPU trainer"
    if same_host and (r.trainer_resources or r.rollout_resources or r.ray_address):
        return "both sides on this host (no ray_address, no custom Ray resources)"
    return None


class ResourcesSection(_Section):
    """Where the parts run. A local Ray cluster by default (no dashboard, no auth token files); ``ray_address``
    joins an existing cluster. ``*_cores`` pin processes to CPU cores (each side gets its own, as on a cluster).
    ``trainer_resources`` / ``rollout_resources``: custom Ray resources each trainer rank / the rollout actor asks
    for (``.options(resources=...)``), which put each side on the nodes that offer them, e.g. ``{"trainer_node":
    1}`` with ``ray start --resources '{"trainer_node": 2}'`` on the trainer's node; a local cluster is started
    with what they ask for. ``ray: false`` is debug mode (``agentrl train --debug``): everything in the
    controller's process, no Ray (:mod:`agentrl.launcher.placement`).

    ``placement`` says whether the two sides divide the cores or take turns on all of them
    (:mod:`agentrl.launcher.colocation`): ``split`` (each side on its own ``*_cores``), ``colocated`` (both on
    every core, the union of ``rollout_cores`` and ``trainer_cores`` if given, phases strictly alternating: needs
    ``rollout.max_staleness: 0``), ``auto`` (colocated when ``max_staleness`` is 0, else split; the choice and why
    are logged and written to ``summary.json``). ``trainer_borrows_idle_cores``: with split cores on one host, the
    trainer also computes on ``rollout_cores`` while the rollout side is idle (:mod:`agentrl.launcher.cores`);
    ``auto`` turns it on wherever it can work (split, both core lists given and disjoint, one CPU trainer rank, no
    custom Ray resources that could put the sides on different nodes); ``true`` demands it; ``false`` (the
    default) leaves the cores as placed. ``engine_borrows_idle_cores`` is the other way round: the SGLang server
    started by the run (one, on CPU) also decodes on ``trainer_cores`` while the trainer waits for rollouts
    (same conditions, and ``auto`` / ``true`` / ``false`` alike)."""

    placement: Literal["split", "colocated", "auto"] = "split"
    ray: bool = True
    ray_address: str | None = None
    trainer_world_size: int = Field(default=1, ge=1)
    trainer_num_cpus: float = Field(default=1.0, gt=0)
    trainer_num_gpus: float = Field(default=0.0, ge=0)
    trainer_resources: dict[str, float] = Field(default_factory=dict)  # per rank; {}: any node
    rollout_num_cpus: float = Field(default=1.0, gt=0)
    rollout_resources: dict[str, float] = Field(default_factory=dict)  # {}: any node
    rollout_cores: list[int] | None = None
    trainer_cores: list[int] | None = None
    # off by default until it shows a gain: on the AMX demo (bf16) the rollout side is idle for 0-33 % of the
    # trainer's micro-batches and no step got faster (docs/results.md); the fp32 path, trainer-bound, is unmeasured
    trainer_borrows_idle_cores: bool | Literal["auto"] = False
    engine_borrows_idle_cores: bool | Literal["auto"] = False
    max_trainer_restarts: int = Field(default=2, ge=0)

    @field_validator("trainer_resources", "rollout_resources")
    @classmethod
    def _custom_resources_only(cls, value: dict[str, float]) -> dict[str, float]:
        builtin = sorted(set(value) & {"CPU", "GPU", "memory", "object_store_memory"})
        if builtin:
            raise ValueError(f"{', '.join(builtin)}: set these with *_num_cpus / *_num_gpus; these mappings hold "
                             "custom Ray resources only")
        if any(v <= 0 for v in value.values()):
            raise ValueError(f"every amount must be > 0, got {value}")
        return value

    @model_validator(mode="after")
    def _borrowing_needs_split_cores(self) -> ResourcesSection:
        for key in ("trainer_borrows_idle_cores", "engine_borrows_idle_cores"):
            if getattr(self, key) is True:
                why = borrowing_obstacle(self, same_host=False)
                if why:
                    raise ValueError(f"{key}: true needs {why}")
        return self

    @model_validator(mode="after")
    def _debug_mode_is_one_process(self) -> ResourcesSection:
        if not self.ray and self.trainer_world_size != 1:
            raise ValueError(f"debug mode (ray: false) runs one trainer rank, got trainer_world_size "
                             f"{self.trainer_world_size}")
        if not self.ray and self.ray_address:
            raise ValueError("ray_address joins a Ray cluster; debug mode (ray: false) uses none")
        if not self.ray and (self.trainer_resources or self.rollout_resources):
            raise ValueError("trainer_resources / rollout_resources place Ray actors; debug mode (ray: false) "
                             "starts none")
        return self

    def local_cluster_resources(self) -> dict[str, float]:
        """The custom resources a local cluster must offer so every actor of the run can be placed."""
        need: dict[str, float] = {}
        for name, amount in self.trainer_resources.items():
            need[name] = need.get(name, 0.0) + amount * self.trainer_world_size
        for name, amount in self.rollout_resources.items():
            need[name] = need.get(name, 0.0) + amount
        return need


class MonitorSection(_Section):
    """Live progress (rich, on a terminal), Prometheus ``/metrics`` on 127.0.0.1 (port 0: any free port; null:
    off), TensorBoard event files in ``runs/<name>/tensorboard``, and optionally W&B / trackio
    (:mod:`agentrl.launcher.trackers`)."""

    live: bool = True
    prometheus_port: int | None = 0
    tensorboard: bool = True
    interval_s: float = Field(default=2.0, gt=0)
    wandb: WandbSection | None = None  # Weights & Biases (pip install 'agentrl[wandb]'); null: off
    trackio: TrackioSection | None = None  # trackio, local unless space_id; null: off


class RunConfig(_Section):
    name: str = ""
    imports: list[str] = Field(default_factory=list)  # modules or .py files to import first (they register envs)
    runs_dir: str = "runs"
    seed: int = 0
    model: str = "tiny"
    steps: int = Field(default=2, ge=1)  # RL steps; the final weight version equals this
    checkpoint_every: int = Field(default=1, ge=1)
    keep_checkpoints: int = Field(default=2, ge=1)  # older ones are deleted (a 135M checkpoint with Adam state is ~1.7 GB)
    keep_weight_versions: int | None = Field(default=4, ge=2)  # published versions kept besides v0 (null: all)
    log_rollouts: Literal["none", "summary", "full"] = "summary"  # runs/<name>/rollouts.jsonl
    engine: EngineSection = Field(default_factory=EngineSection)
    redis: RedisSection = Field(default_factory=RedisSection)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    rewards: RewardsConfig = Field(default_factory=RewardsConfig)
    env: EnvSection = Field(default_factory=EnvSection)
    data: DataSection = Field(default_factory=DataSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    gateway: GatewaySection = Field(default_factory=GatewaySection)
    sft: SFTSection = Field(default_factory=SFTSection)
    trainer: TrainerSettings = Field(default_factory=TrainerSettings)  # with the top-level model: TrainerConfig
    weight_sync: WeightSyncSettings = Field(default_factory=WeightSyncSettings)
    resources: ResourcesSection = Field(default_factory=ResourcesSection)
    monitor: MonitorSection = Field(default_factory=MonitorSection)

    @model_validator(mode="before")
    @classmethod
    def _cosine_spans_the_run(cls, data: Any) -> Any:
        """``trainer.optimizer.schedule: cosine`` without ``total_steps`` decays over the whole run: ``steps`` x
        ``trainer.mini_batches`` optimiser updates (the Trainer alone, outside a run, still needs the number)."""
        if not isinstance(data, dict) or not isinstance(data.get("trainer"), dict):
            return data
        trainer = data["trainer"]
        opt = trainer.get("optimizer")
        if not isinstance(opt, dict) or opt.get("schedule") != "cosine" or opt.get("total_steps") is not None:
            return data
        try:
            updates = int(data.get("steps", cls.model_fields["steps"].default)) * int(trainer.get("mini_batches", 1))
        except (TypeError, ValueError):
            return data  # a malformed steps or mini_batches: their own validation says so
        return {**data, "trainer": {**trainer, "optimizer": {**opt, "total_steps": updates}}}

    @field_validator("trainer", mode="before")
    @classmethod
    def _model_is_top_level(cls, value: Any) -> Any:
        if isinstance(value, dict) and "model" in value:
            raise ValueError("set the model at the top level (`model:`), not in the trainer section")
        return value

    @model_validator(mode="after")
    def _colocated_phases_alternate(self) -> RunConfig:
        """Colocated sides take turns on the same cores (or GPU): only with η = 0 does the rollout wait for each
        new version while the trainer steps, and the trainer for each batch while the rollout generates. With η ≥ 1
        both phases run at once, each with threads for every core (twice as many threads as cores on CPU; on GPU
        the trainer would step while SGLang holds its memory)."""
        eta = self.rollout.scheduler.max_staleness
        if self.resources.placement == "colocated" and eta != 0:
            raise ValueError(f"resources.placement: colocated needs rollout.max_staleness: 0 (got {eta}): colocated "
                             "sides take turns on the same cores, and with max_staleness >= 1 rollout and training "
                             "overlap; set rollout.max_staleness=0, or resources.placement=split (or auto, which "
                             "picks split for max_staleness >= 1)")
        return self

    @model_validator(mode="after")
    def _tensor_sync_stays_on_one_host(self) -> RunConfig:
        """``weight_sync: tensor`` shares the trainer's memory, so the servers must be on the trainer's host: a
        running server named by a non-local URL, or trainer and rollout placed on nodes with different resources,
        cannot be (a placement it cannot see here is checked at each update, which then falls back to disk)."""
        if self.weight_sync.mode != "tensor":
            return self
        remote = [u for u in self.engine.urls if not _local_url(u)]
        if remote:
            raise ValueError(f"weight_sync: tensor loads weights from the trainer's shared memory, so the servers "
                             f"must run on its host; engine.url names {', '.join(remote)}: use weight_sync: "
                             "distributed (or disk with a shared filesystem)")
        r = self.resources
        if r.trainer_resources and r.rollout_resources and not set(r.trainer_resources) & set(r.rollout_resources):
            raise ValueError(f"weight_sync: tensor needs the trainer and the servers on one host, but "
                             f"resources.trainer_resources {r.trainer_resources} and rollout_resources "
                             f"{r.rollout_resources} place them on different nodes: use weight_sync: distributed")
        return self

    @model_validator(mode="after")
    def _trainer_scores_at_the_sampling_temperature(self) -> RunConfig:
        """The trainer's log-probs must be those of the distribution the engine sampled from (logits / T), or
        every importance ratio is off by the temperature: ``trainer.loss.temperature`` follows
        ``rollout.temperature`` unless set, and may not contradict it (greedy sampling, T = 0, leaves it alone)."""
        sampled = self.rollout.sampling.temperature
        loss = self.trainer.loss
        if sampled <= 0:
            return self
        if "temperature" not in loss.model_fields_set:
            if sampled != 1.0:
                self.trainer = self.trainer.model_copy(update={"loss": loss.model_copy(update={"temperature": sampled})})
        elif loss.temperature != sampled:
            raise ValueError(f"trainer.loss.temperature {loss.temperature} differs from rollout.temperature "
                             f"{sampled}: the trainer must score tokens at the temperature they were sampled at "
                             "(leave trainer.loss.temperature unset to follow the rollout's)")
        return self

    @property
    def trainer_device(self) -> Literal["cpu", "cuda"]:
        """``trainer.device`` with ``auto`` made concrete the way the launcher places the ranks: cuda when they are
        given GPUs (``resources.trainer_num_gpus``), else cpu."""
        if self.trainer.device != "auto":
            return self.trainer.device
        return "cuda" if self.resources.trainer_num_gpus > 0 else "cpu"

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


def _local_url(url: str) -> bool:
    host = urlparse(url).hostname or ""
    return host in ("localhost", "::1", "0.0.0.0", socket.gethostname()) or host.startswith("127.")


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


def config_keys(cls: type[BaseModel] = RunConfig, prefix: str = "") -> Iterator[str]:
    """Every dotted key a YAML may set under ``cls`` (a composed section's parts are flat: ``rollout.temperature``)."""
    for name in _keys_here(cls):
        yield prefix + name
        field = cls.model_fields.get(name)
        for inner in (field.annotation, *getattr(field.annotation, "__args__", ())) if field is not None else ():
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                yield from config_keys(inner, f"{prefix}{name}.")


def _keys_here(cls: type[BaseModel]) -> list[str]:
    return cls.yaml_keys() if issubclass(cls, _Composed) else list(cls.model_fields)


def _yaml_location(root: type[BaseModel], loc: tuple[Any, ...]) -> tuple[type[BaseModel] | None, tuple[str, ...]]:
    """The model holding the key at ``loc`` and the key's YAML path (a composed section's part names dropped)."""
    cls: type[BaseModel] | None = root
    path: list[str] = []
    for part in map(str, loc):
        if cls is None:
            path.append(part)
            continue
        if issubclass(cls, _Composed) and part in cls.PARTS:
            cls = None  # a part's own keys are the section's
            continue
        path.append(part)
        field = cls.model_fields.get(part)
        candidates = [field.annotation, *getattr(field.annotation, "__args__", ())] if field is not None else []
        models = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        cls = models[0] if models else None
    return cls, tuple(path)


def describe_errors(exc: ValidationError, root: type[BaseModel]) -> str:
    """One line per error, ``dotted.key: what is wrong``; an unknown key names the closest known one."""
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        if err["type"] == "extra_forbidden":
            holder, where = _yaml_location(root, loc[:-1])
            known = sorted(_keys_here(holder)) if holder is not None else []
            close = closest(str(loc[-1]), known)
            hint = f" (did you mean {'.'.join([*where, close])!r}?)" if close else ""
            key = ".".join([*where, str(loc[-1])])
            lines.append(f"  {key}: unknown key{hint}; known keys here: {', '.join(known) or '?'}")
        else:
            key = ".".join(_yaml_location(root, loc)[1])
            lines.append(f"  {key or '(top level)'}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


def save_config(config: RunConfig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
