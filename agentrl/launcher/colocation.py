"""Split or colocated: whether the rollout side and the trainer divide the machine's cores or take turns on all.

    split      rollout (SGLang, sandboxes) on ``rollout_cores``, trainer on ``trainer_cores``; with η ≥ 1 both
               work at once, each on its own cores (as on a cluster)
    colocated  both on every core (the union of ``rollout_cores`` and ``trainer_cores`` when given, else every
               core this process may use), strictly alternating: generate a step's batch → train it → load the
               new version → generate … (η = 0, which the config enforces); each phase runs with one thread per
               core (SGLang's ``OMP_NUM_THREADS``, the trainer's ``num_threads``)
    auto       colocated when η = 0, split when η ≥ 1 (the rule, below)

Why the rule: with η = 0 the two sides alternate anyway (the rollout waits for each version, the trainer for each
batch), so split cores leave one side's cores idle in every phase; colocated gives each phase all of them. With
η ≥ 1 the phases overlap, and colocated would run 2× as many compute threads as cores; split keeps each side's
threads on its own cores. An idle side costs nothing: SGLang runs with ``--sleep-on-idle`` (its scheduler would
otherwise spin a core) and the trainer blocks on the queue.

On GPU, colocated means SGLang and the trainer on the same devices: SGLang is started with
``--enable-memory-saver`` and releases its weights and KV cache (``/release_memory_occupation``) before the trainer
gets a step's batch, and takes them back (``/resume_memory_occupation``) before it loads the new version
(:class:`MemoryHandover`). On CPU there is nothing to hand over (one RAM, and SGLang's memory saver is CUDA's).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

from agentrl.errors import ConfigError
from agentrl.launcher.config import RunConfig, borrowing_obstacle
from agentrl.launcher.cores import engine_borrow_flag

logger = logging.getLogger(__name__)

MEMORY_SAVER_FLAG = "--enable-memory-saver"


@dataclass(frozen=True, slots=True)
class PlacementChoice:
    """What a run's ``resources.placement`` resolved to on this machine, and why (logged, in ``summary.json``).
    Cores are None where nothing is pinned (debug mode, or split without ``*_cores``); threads None where they
    are left as they are."""

    requested: Literal["split", "colocated", "auto"]
    placement: Literal["split", "colocated"]
    reason: str
    rollout_cores: list[int] | None
    trainer_cores: list[int] | None
    engine_threads: int | None
    trainer_threads: int | None
    release_engine_memory: bool  # GPU colocated: SGLang hands its memory to the trainer every step
    trainer_borrows: list[int] | None = None  # split: the rollout cores the trainer also uses while they idle
    borrow_reason: str = ""
    engine_borrows: list[int] | None = None  # split: the trainer cores SGLang also uses while the trainer waits
    engine_borrow_reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_placement(cfg: RunConfig, available: Sequence[int] | None = None) -> PlacementChoice:
    """Resolve ``resources.placement`` for ``cfg`` on cores ``available`` (default: this process's affinity)."""
    r = cfg.resources
    eta = cfg.rollout.scheduler.max_staleness
    cores = sorted(available if available is not None else os.sched_getaffinity(0))
    if r.placement == "auto":
        placement: Literal["split", "colocated"] = "colocated" if eta == 0 else "split"
        reason = ("auto: max_staleness 0, the phases alternate, so each phase gets every core" if eta == 0 else
                  f"auto: max_staleness {eta}, rollout and training overlap, so each side keeps its own cores")
    else:
        placement = r.placement
        reason = "as configured"
    world = r.trainer_world_size
    engine_threads: int | None
    trainer_threads: int | None
    if placement == "colocated":
        given = sorted(set(r.rollout_cores or []) | set(r.trainer_cores or []))
        shared = given or cores
        rollout_cores = trainer_cores = shared if r.ray else None  # debug mode: one process, nothing pinned
        engine_threads, trainer_threads = len(shared), max(1, len(shared) // world)
    else:
        rollout_cores, trainer_cores = r.rollout_cores, r.trainer_cores
        engine_threads = len(rollout_cores) if rollout_cores else None
        trainer_threads = max(1, len(trainer_cores) // world) if trainer_cores else None
    def borrowing(key: str, extra: str | None, cores: list[int] | None, what: str) -> tuple[list[int] | None, str]:
        setting = getattr(r, key)
        if setting is False:
            return None, f"off (resources.{key}: false)"
        obstacle = borrowing_obstacle(r.model_copy(update={"placement": placement}),
                                      trainer_on_gpu=cfg.trainer.device == "cuda",
                                      same_host=setting == "auto") or extra
        if obstacle is not None and setting is True:
            raise ConfigError(f"resources.{key}: true needs {obstacle} (placement {placement}: {reason})")
        return (None, f"off: needs {obstacle}") if obstacle is not None else (sorted(cores or []), what)

    borrows, borrow_reason = borrowing("trainer_borrows_idle_cores", None, rollout_cores,
                                       "the trainer also uses the rollout cores while the rollout side is idle")
    engine_borrows, engine_reason = borrowing("engine_borrows_idle_cores", engine_borrowing_obstacle(cfg),
                                              trainer_cores, "SGLang also uses the trainer cores while the trainer "
                                              "waits for rollouts")
    return PlacementChoice(requested=r.placement, placement=placement, reason=reason, rollout_cores=rollout_cores,
                           trainer_cores=trainer_cores, engine_threads=engine_threads,
                           trainer_threads=trainer_threads,
                           release_engine_memory=hands_over_memory(cfg, placement), trainer_borrows=borrows,
                           borrow_reason=borrow_reason, engine_borrows=engine_borrows,
                           engine_borrow_reason=engine_reason)


def engine_borrowing_obstacle(cfg: RunConfig) -> str | None:
    """What, on the engine's side, keeps SGLang from borrowing the trainer's cores (None: nothing): it must be one
    server on CPU that the run starts itself, with agentrl's CPU stand-in active (the hook lives there)."""
    e = cfg.engine
    if e.server.device != "cpu":
        return "an SGLang server on CPU"
    if e.url is not None or e.num_servers != 1:
        return "one SGLang server started by the run (engine.num_servers 1, no engine.url)"
    if e.server.env.get("AGENTRL_SGLANG_CPU_PATCHES") == "0":
        return "agentrl's CPU patches in SGLang (engine.server.env has AGENTRL_SGLANG_CPU_PATCHES=0)"
    return None


def hands_over_memory(cfg: RunConfig, placement: str | None = None) -> bool:
    """True if SGLang gives its GPU memory to the trainer every step: colocated, on GPU, servers started by the run
    (a server at ``engine.url`` was started without ``--enable-memory-saver`` as far as we know)."""
    placement = placement or cfg.resources.placement
    return placement == "colocated" and cfg.engine.server.device == "cuda" and cfg.engine.url is None


def apply_placement(cfg: RunConfig, choice: PlacementChoice) -> RunConfig:
    """``cfg`` with the choice written in: the resolved placement and cores, the trainer's ``num_threads`` and
    SGLang's ``OMP_NUM_THREADS`` (each unless the user set it: theirs wins), ``--enable-memory-saver`` when SGLang
    hands its GPU memory over. ``config.yaml`` then records what ran."""
    resources = cfg.resources.model_copy(update={"placement": choice.placement, "rollout_cores": choice.rollout_cores,
                                                 "trainer_cores": choice.trainer_cores,
                                                 "trainer_borrows_idle_cores": bool(choice.trainer_borrows),
                                                 "engine_borrows_idle_cores": bool(choice.engine_borrows)})
    trainer = cfg.trainer
    if choice.trainer_threads is not None and trainer.num_threads is None:
        trainer = trainer.model_copy(update={"num_threads": choice.trainer_threads})
    server = cfg.engine.server
    if choice.engine_threads is not None and server.device == "cpu" and "OMP_NUM_THREADS" not in server.env:
        # Ray gives each actor OMP_NUM_THREADS = its num_cpus (1), which SGLang would inherit from the rollout actor
        server = server.model_copy(update={"env": {**server.env, "OMP_NUM_THREADS": str(choice.engine_threads)}})
    if choice.engine_borrows:  # read by our sgl_kernel stand-in in the scheduler (sgl_kernel/_borrow.py)
        server = server.model_copy(update={"env": {
            **server.env, "AGENTRL_BORROW_CORES": ",".join(map(str, choice.engine_borrows)),
            "AGENTRL_BORROW_FLAG": str(engine_borrow_flag(cfg.run_dir()))}})
    if choice.release_engine_memory and MEMORY_SAVER_FLAG not in server.extra_args:
        server = server.model_copy(update={"extra_args": [*server.extra_args, MEMORY_SAVER_FLAG]})
    engine = cfg.engine.model_copy(update={"server": server})
    return cfg.model_copy(update={"resources": resources, "trainer": trainer, "engine": engine})


def resolve_placement(cfg: RunConfig) -> tuple[RunConfig, PlacementChoice]:
    """Choose, log and apply the placement of ``cfg`` on this machine."""
    choice = choose_placement(cfg)
    logger.info("placement: %s (%s); rollout cores %s, trainer cores %s; SGLang threads %s, trainer threads %s%s",
                choice.placement, choice.reason, choice.rollout_cores or "unpinned",
                choice.trainer_cores or "unpinned", choice.engine_threads or "as inherited",
                choice.trainer_threads or "as set", "; SGLang releases its GPU memory while the trainer steps"
                if choice.release_engine_memory else "")
    if choice.placement == "split":
        logger.info("trainer borrows idle rollout cores: %s", choice.borrow_reason if not choice.trainer_borrows
                    else f"{choice.trainer_borrows} ({choice.borrow_reason})")
        logger.info("SGLang borrows the waiting trainer's cores: %s", choice.engine_borrow_reason
                    if not choice.engine_borrows else f"{choice.engine_borrows} ({choice.engine_borrow_reason})")
    return apply_placement(cfg, choice), choice


def process_cores(pid: int) -> dict[str, Any]:
    """What a process was given: its CPU affinity and its ``OMP_NUM_THREADS`` (None when unset or unreadable)."""
    try:
        cores: list[int] | None = sorted(os.sched_getaffinity(pid))
    except OSError:
        cores = None
    threads = None
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"OMP_NUM_THREADS="):
                    threads = item.split(b"=", 1)[1].decode()
    except OSError:
        pass
    return {"pid": pid, "cores": cores, "omp_num_threads": threads}


class MemoryEngine(Protocol):
    async def release_memory(self) -> None: ...
    async def resume_memory(self) -> None: ...


class MemoryHandover:
    """GPU colocated: SGLang gives its memory to the trainer for every step and takes it back after.

    Put in front of the trajectory queue and the weight loader of the rollout side: the last group of a step is
    queued only after SGLang released its memory (with η = 0 nothing else is generating then: the step's other
    groups are queued, the next step's wait for its version), so the trainer never starts a step while SGLang holds
    the GPU; a new version is loaded only after SGLang took its memory back. ``groups_per_step`` counts groups in
    queue order from the run's start, as the trainer reads them (:mod:`agentrl.launcher.protocol`)."""

    def __init__(self, engine: MemoryEngine, sink: Any, load: Callable[[Any], Awaitable[int]], *,
                 groups_per_step: int) -> None:
        self.engine, self.sink, self._load, self.groups_per_step = engine, sink, load, groups_per_step
        self.queued = 0
        self.released = False
        self.handovers = 0

    async def put(self, trajectories: Sequence[Any]) -> Any:
        if (self.queued + 1) % self.groups_per_step == 0 and not self.released:
            await self.engine.release_memory()
            self.released = True
            self.handovers += 1
        out = await self.sink.put(trajectories)
        self.queued += 1
        return out

    async def load_weights(self, wv: Any) -> int:
        if self.released:
            await self.engine.resume_memory()
            self.released = False
        return await self._load(wv)
