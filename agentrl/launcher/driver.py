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

from agentrl.env import default_registry
from agentrl.errors import TrainerError
from agentrl.launcher.config import RunConfig, save_config
from agentrl.launcher.monitor import RunMonitor
from agentrl.launcher.resources import check_data, load_imports, pin_to_cores, sft_traces_file
from agentrl.models import resolve_model
from agentrl.queue import connect_redis
from agentrl.tokenizer import ChatTokenizer

logger = logging.getLogger(__name__)


def _ray_init(cfg: RunConfig) -> Any:
    import ray

    if ray.is_initialized():
        return ray
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local cluster: no token file in the user's home
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
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

    from agentrl.launcher.rollout_worker import RolloutWorker

    @ray.remote
    class RolloutActor(RolloutWorker):
        def __init__(self, cfg: RunConfig, run_dir: Path, redis_url: str) -> None:
            _log_to(Path(run_dir) / "logs" / "rollout.log")
            super().__init__(cfg, run_dir, redis_url)

        def pid(self) -> int:
            return os.getpid()

    @ray.remote
    class TrainerActor:
        def __init__(self, run_dir: str, env: dict[str, str], cores: list[int] | None) -> None:
            os.environ.update(env)
            if cores:
                pin_to_cores(cores)
            self.run_dir = Path(run_dir)
            _log_to(self.run_dir / "logs" / f"trainer-{env.get('RANK', '0')}.log")

        def pid(self) -> int:
            return os.getpid()

        def train(self) -> int:
            from agentrl.trainer.worker import train

            rank = os.environ.get("RANK", "0")
            (self.run_dir / "logs" / f"trainer-{rank}.pid").write_text(str(os.getpid()))
            asyncio.run(train(self.run_dir))
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
                str(self.run_dir), env, r.trainer_cores)
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


async def run_training(cfg: RunConfig) -> dict[str, Any]:
    """Run a whole training job as configured; returns (and writes) ``summary.json``."""
    from agentrl.launcher.report import summarize, write_report

    cfg = cfg.with_default_name().with_absolute_paths()
    load_imports(cfg.imports)
    check_data(cfg)  # data files exist and hold the keys: fail before anything starts
    run_dir = cfg.run_dir().resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    default_registry.get_env(cfg.env.name)  # fail fast, naming the known environments
    t_start = time.monotonic()
    base_model = resolve_model(cfg.model)
    sft_data = None
    if cfg.sft.enabled and cfg.sft.steps > 0:
        sft_data = sft_traces_file(cfg, ChatTokenizer.from_pretrained(base_model), run_dir / "sft_traces.jsonl")
    ray = _ray_init(cfg)
    rollout_cls, trainer_cls = _actor_classes()
    evals: dict[str, Any] = {}
    async with AsyncExitStack() as stack:
        stack.callback(_kill_recorded, run_dir)
        redis = await connect_redis(cfg.redis.url, run_dir / "redis")
        stack.push_async_callback(redis.aclose)
        trainers = TrainerGroup(cfg, run_dir, redis.url, trainer_cls)
        stack.callback(trainers.kill)
        trainers.start()
        rollout = rollout_cls.options(num_cpus=cfg.resources.rollout_num_cpus).remote(cfg, run_dir, redis.url)
        stack.callback(ray.kill, rollout)
        stack.push_async_callback(_aclose_actor, rollout)
        engine_url = await _first(rollout.start.remote(), trainers)
        m = cfg.monitor
        monitor = RunMonitor(run_dir, cfg.steps, live=m.live, prometheus_port=m.prometheus_port,
                             tensorboard=m.tensorboard, interval_s=m.interval_s)
        stack.callback(monitor.close)
        follow = asyncio.ensure_future(monitor.follow(rollout))
        stack.callback(follow.cancel)
        heldout = cfg.data.num_heldout > 0
        if heldout and cfg.sft.enabled:
            evals["before"] = await _first(rollout.evaluate_heldout.remote("before"), trainers)
        await _first(rollout.load_version.remote(0), trainers)
        if heldout:
            evals["sft"] = await _first(rollout.evaluate_heldout.remote("sft"), trainers)
        t_rl = time.monotonic()
        rollout_stats = await _first(
            rollout.run.remote(cfg.steps * cfg.rollout.groups_per_step, cfg.steps), trainers)
        await trainers.wait()
        rl_wall_s = time.monotonic() - t_rl
        if heldout:
            evals["after"] = await rollout.evaluate_heldout.remote("after")
        served = await rollout.weight_version.remote()
        left = await rollout.queue_length.remote()
        monitor.update(await rollout.progress.remote())
        summary = summarize(cfg, run_dir, rollout_stats=rollout_stats, evals=evals, served_version=served,
                            engine_url=engine_url, queue_left=left, trainer_restarts=trainers.restarts,
                            wall_time_s=time.monotonic() - t_start)
        summary["metrics_url"] = monitor.metrics_url
        if sft_data is not None:
            summary["sft_data"] = sft_data.as_dict()  # traces, tokens, truncated (never dropped)
        summary["rl_wall_s"] = round(rl_wall_s, 2)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    write_report(run_dir, summary)
    logger.info("run %s done: final version %s, reward %s → %s", cfg.name, summary["final_weight_version"],
                summary["reward_first"], summary["reward_last"])
    return summary


async def _aclose_actor(actor: Any) -> None:
    try:
        await asyncio.wait_for(actor.aclose.remote(), 30)
    except Exception as exc:  # the actor may be dead already; the ledger kill still runs
        logger.debug("rollout actor close: %r", exc)
