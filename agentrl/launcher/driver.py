"""The single controller of a training run: it places the parts on Ray, wires them, watches them, stops them.

    controller ── Redis (embedded in the run dir, or external) ──────────────────────────────┐
       │                                                                                      │
       ├─ TrainerActor × world size (SFT → v0, then RL steps v1..vN; restarted from its checkpoint if it dies)
       └─ RolloutActor (SGLang server, sandbox, rewards, RolloutScheduler) ─── trajectories ──┘

Data never passes through the controller: trajectories go rollout → Redis → trainer, weights go trainer →
``weights/v<N>/`` → SGLang. It only starts things, waits on them, collects small summaries and writes the report.
Every process started is stopped at the end, also on Ctrl-C or an error (Ray actors with ``ray.kill``; the
SGLang process groups they started from ``logs/processes.jsonl``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from agentrl.errors import TrainerError
from agentrl.hardware import engine_dtype, resolve_dtype
from agentrl.launcher.config import RunConfig, save_config
from agentrl.launcher.monitor import RunMonitor
from agentrl.launcher.preflight import check_run
from agentrl.launcher.resources import pin_to_cores, sft_traces_file
from agentrl.launcher.rundir import ResumePoint, claim_run_dir
from agentrl.launcher.trackers import make_trackers
from agentrl.queue import connect_redis
from agentrl.tokenizer import ChatTokenizer

logger = logging.getLogger(__name__)


def _ray_init(cfg: RunConfig) -> Any:
    import ray

    if ray.is_initialized():
        return ray
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local cluster: no token file in the user's home
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray starts its workers at nice 15 (to keep its own daemons responsive): the trainer and rollout actors, SGLang
    # and every sandbox they spawn then lose the CPU to any other process on the box (seen: a niced pytest at nice
    # 10 took the cores from a demo). Our actors are the work; run them at the driver's priority.
    os.environ.setdefault("RAY_worker_niceness", "0")
    if cfg.resources.ray_address:
        ray.init(address=cfg.resources.ray_address, log_to_driver=True)
    else:
        need = cfg.resources.rollout_num_cpus + cfg.resources.trainer_world_size * cfg.resources.trainer_num_cpus
        ray.init(include_dashboard=False, num_cpus=max(need, float(os.cpu_count() or 1)), log_to_driver=True,
                 configure_logging=False)
    return ray


def _log_to(path: Path) -> None:
    """Send this process's agentrl logs to a file of the run (Ray actors run in their own processes)."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def _actor_classes() -> tuple[Any, Any]:
    import ray

    from agentrl.launcher.rollout_process import RolloutWorker

    @ray.remote
    class RolloutActor(RolloutWorker):
        def __init__(self, cfg: RunConfig, run_dir: Path, redis_url: str) -> None:
            _log_to(Path(run_dir) / "logs" / "rollout.log")
            super().__init__(cfg, run_dir, redis_url)

        def pid(self) -> int:
            return os.getpid()

    @ray.remote
    class TrainerActor:
        def __init__(self, cfg: RunConfig, run_dir: str, env: dict[str, str], cores: list[int] | None) -> None:
            os.environ.update(env)  # torch.distributed's rendezvous
            if cores:
                pin_to_cores(cores)
            self.cfg, self.run_dir = cfg, Path(run_dir)
            _log_to(self.run_dir / "logs" / f"trainer-{env.get('RANK', '0')}.log")

        def pid(self) -> int:
            return os.getpid()

        def train(self) -> int:
            from agentrl.launcher.trainer_process import train

            rank = int(os.environ["RANK"])
            (self.run_dir / "logs" / f"trainer-{rank}.pid").write_text(str(os.getpid()))
            asyncio.run(train(self.cfg, self.run_dir, os.environ["AGENTRL_REDIS_URL"], rank=rank))
            return 0

    return RolloutActor, TrainerActor


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TrainerGroup:
    """The trainer ranks as Ray actors; restarted together (from the last checkpoint) when one dies."""

    def __init__(self, cfg: RunConfig, run_dir: Path, redis_url: str, actor_cls: Any) -> None:
        self.cfg, self.run_dir, self.redis_url, self.cls = cfg, run_dir, redis_url, actor_cls
        self.actors: list[Any] = []
        self.refs: list[Any] = []
        self.restarts = 0

    def start(self) -> None:
        r = self.cfg.resources
        world, port = r.trainer_world_size, _free_port()
        self.actors, self.refs = [], []
        for rank in range(world):
            env = {"AGENTRL_REDIS_URL": self.redis_url, "RANK": str(rank), "LOCAL_RANK": str(rank),
                   "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            actor = self.cls.options(num_cpus=r.trainer_num_cpus, num_gpus=r.trainer_num_gpus,
                                     name=f"trainer-{self.cfg.name}-{rank}-{self.restarts}").remote(
                self.cfg, str(self.run_dir), env, r.trainer_cores)
            self.actors.append(actor)
        self.refs = [a.train.remote() for a in self.actors]

    async def wait(self) -> None:
        """Return when every rank finished; restart the group on a death, up to ``max_trainer_restarts``."""
        import ray

        while True:
            try:
                await asyncio.gather(*self.refs)
                return
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                if self.restarts >= self.cfg.resources.max_trainer_restarts:
                    raise TrainerError(f"the trainer failed {self.restarts + 1} times; last error: {exc}; "
                                       f"see {self.run_dir / 'logs'}") from exc
                self.restarts += 1
                logger.warning("trainer died (%s); restarting from the last checkpoint (restart %d/%d)",
                               type(exc).__name__, self.restarts, self.cfg.resources.max_trainer_restarts)
                self.kill()
                self.start()

    def kill(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)


async def _first(coro: Any, trainers: TrainerGroup) -> Any:
    """Await ``coro``; if the trainer group fails for good first, raise its error instead of waiting forever."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(trainers.wait())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        watch.result()  # raises if the trainer failed for good
        return await work  # the trainer finished first: the rollout side still completes its part
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)


def _kill_recorded(run_dir: Path) -> None:
    path = run_dir / "logs" / "processes.jsonl"
    if not path.exists():
        return
    for line in path.read_text().splitlines():
        pid = json.loads(line)["pid"]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.5)


def resolve_precision(cfg: RunConfig) -> RunConfig:
    """``dtype: auto`` of the trainer and of the engine made concrete for this machine (agentrl.hardware), so
    ``config.yaml`` records what ran. A GPU trainer placed by Ray on another node keeps ``auto`` when this
    process sees no GPU: the trainer resolves it where it runs and logs the choice."""
    update: dict[str, Any] = {}
    device = cfg.trainer.device
    if device == "auto":
        device = "cuda" if cfg.resources.trainer_num_gpus > 0 else "cpu"
    if cfg.trainer.dtype == "auto" and (device == "cpu" or _sees_gpu()):
        p = resolve_dtype("auto", device)
        update["trainer"] = cfg.trainer.model_copy(update={"dtype": p.dtype})
        logger.info("trainer dtype: auto -> %s (%s)", p.dtype, p.reason)
    server = cfg.engine.server
    if server.dtype == "auto" and cfg.engine.url is None:
        chosen = engine_dtype("auto", server.device)
        update["engine"] = cfg.engine.model_copy(update={"server": server.model_copy(update={"dtype": chosen})})
        logger.info("engine dtype: auto -> %s", chosen if chosen != "auto" else "the model's own (SGLang on GPU)")
    return cfg.model_copy(update=update)


def _sees_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


async def run_training(cfg: RunConfig, *, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Run a whole training job as configured; returns (and writes) ``summary.json``.

    Everything checkable is checked before anything starts (:mod:`agentrl.launcher.preflight`); a run directory
    that holds a run needs ``resume`` or ``overwrite`` (:mod:`agentrl.launcher.rundir`)."""
    cfg = resolve_precision(cfg.with_default_name().with_absolute_paths())
    base_model = check_run(cfg)
    run_dir = cfg.run_dir().resolve()
    lock, point = claim_run_dir(run_dir, resume=resume, overwrite=overwrite)
    try:
        return await _run(cfg, run_dir, base_model, point)
    finally:
        lock.close()


async def _run(cfg: RunConfig, run_dir: Path, base_model: Path, point: ResumePoint | None) -> dict[str, Any]:
    from agentrl.launcher.report import summarize, write_report

    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    t_start = time.monotonic()
    sft_data = None
    if cfg.sft.enabled and cfg.sft.steps > 0:
        sft_data = sft_traces_file(cfg, ChatTokenizer.from_pretrained(base_model), run_dir / "sft_traces.jsonl")
    ray = _ray_init(cfg)
    rollout_cls, trainer_cls = _actor_classes()
    evals = _saved_evals(run_dir) if point is not None else {}
    async with AsyncExitStack() as stack:
        stack.callback(_kill_recorded, run_dir)
        redis = await connect_redis(cfg.redis.url, run_dir / "redis")
        stack.push_async_callback(redis.aclose)
        carried = await _rewind(cfg, redis.client, point) if point is not None else 0
        trainers = TrainerGroup(cfg, run_dir, redis.url, trainer_cls)
        stack.callback(trainers.kill)
        trainers.start()
        rollout = rollout_cls.options(num_cpus=cfg.resources.rollout_num_cpus).remote(cfg, run_dir, redis.url)
        stack.callback(ray.kill, rollout)
        stack.push_async_callback(_aclose_actor, rollout)
        engine_url = await _first(rollout.start.remote(), trainers)
        m = cfg.monitor
        trackers = make_trackers(m.wandb, m.trackio, name=cfg.name, run_dir=run_dir,
                                 config=cfg.model_dump(mode="json"))
        monitor = RunMonitor(run_dir, cfg.steps, live=m.live, prometheus_port=m.prometheus_port,
                             tensorboard=m.tensorboard, interval_s=m.interval_s, trackers=trackers)
        stack.callback(monitor.close)
        follow = asyncio.ensure_future(monitor.follow(rollout))
        stack.callback(follow.cancel)
        heldout = cfg.data.num_heldout > 0
        if heldout and cfg.sft.enabled and "before" not in evals:
            evals["before"] = await _first(rollout.evaluate_heldout.remote("before"), trainers)
            _save_evals(run_dir, evals)
        if (heldout and "sft" not in evals) or point is None or point.version == 0:
            await _first(rollout.load_version.remote(0), trainers)
        if heldout and "sft" not in evals:
            evals["sft"] = await _first(rollout.evaluate_heldout.remote("sft"), trainers)
            _save_evals(run_dir, evals)
        start_version = point.version if point is not None else 0
        if start_version > 0:  # the resumed trainer re-publishes it (re-exported if it was pruned)
            await _first(rollout.load_version.remote(start_version), trainers)
        # groups the trainer still needs, less the complete groups waiting in the queue (carried from before)
        r = cfg.rollout.scheduler
        total_groups = max(0, (cfg.steps - start_version) * r.groups_per_step - carried // r.n_samples)
        t_rl = time.monotonic()
        rollout_stats = await _first(rollout.run.remote(total_groups, cfg.steps), trainers)
        await trainers.wait()
        rl_wall_s = time.monotonic() - t_rl
        if heldout:
            evals["after"] = await rollout.evaluate_heldout.remote("after")
            _save_evals(run_dir, evals)
        served = await rollout.weight_version.remote()
        left = await rollout.queue_length.remote()
        monitor.update(await rollout.progress.remote())
        summary = summarize(cfg, run_dir, rollout_stats=rollout_stats, evals=evals, served_version=served,
                            engine_url=engine_url, queue_left=left, trainer_restarts=trainers.restarts,
                            wall_time_s=time.monotonic() - t_start,
                            resumed_from_step=point.step if point is not None else None, carried_in=carried)
        summary["metrics_url"] = monitor.metrics_url
        if sft_data is not None:
            summary["sft_data"] = sft_data.as_dict()  # traces, tokens, truncated (never dropped)
        summary["rl_wall_s"] = round(rl_wall_s, 2)
        monitor.finish(summary)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    write_report(run_dir, summary)
    logger.info("run %s done: final version %s, reward %s → %s", cfg.name, summary["final_weight_version"],
                summary["reward_first"], summary["reward_last"])
    return summary


async def _rewind(cfg: RunConfig, client: Any, point: ResumePoint) -> int:
    """Before a resumed run starts anything: finish the checkpoint's acknowledgements (idempotent), forget the
    versions published after the checkpoint (their steps are trained again; the one of the checkpoint too, so
    that loaders wait until the trainer has re-exported and re-published it) and count what the queue holds."""
    from agentrl.launcher.protocol import queue_capacity, registry_namespace, stream_name
    from agentrl.queue import TrajectoryQueue, WeightRegistry

    async with TrajectoryQueue(client, stream_name(cfg.name), consumer="driver",
                               capacity=queue_capacity(cfg)) as queue:
        await queue.ack(list(point.entry_ids))
        carried = (await queue.stats()).length
    async with WeightRegistry(client, registry_namespace(cfg.name)) as registry:
        await registry.rewind(point.version - 1 if point.version > 0 else 0)
    logger.info("resuming %s after step %d (version %d); %d trajectories wait in the queue", cfg.name, point.step,
                point.version, carried)
    return carried


def _saved_evals(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "evals.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _save_evals(run_dir: Path, evals: dict[str, Any]) -> None:
    (run_dir / "evals.json").write_text(json.dumps(evals, indent=2))


async def _aclose_actor(actor: Any) -> None:
    try:
        await asyncio.wait_for(actor.aclose.remote(), 30)
    except Exception as exc:  # the actor may be dead already; the ledger kill still runs
        logger.debug("rollout actor close: %r", exc)
