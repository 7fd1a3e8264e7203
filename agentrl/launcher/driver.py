"""The single controller of a training run: it starts the parts, wires them, watches them, stops them.

    Redis (embedded or external) ─┬─ trainer process (SFT → v0, then RL steps → v1..vN, metrics.jsonl)
    SGLang server ────────────────┤
    sandbox + rewards ────────────┴─ rollout (RolloutScheduler in this process's event loop)

Data never passes through the controller's own code: trajectories go rollout → Redis → trainer, weights go
trainer → ``weights/v<N>/`` → SGLang. Every process started is stopped at the end, also on Ctrl-C or an error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from agentrl.async_rollout import EpisodeBudget, EpisodeRunner, RolloutConfig, RolloutScheduler
from agentrl.engine import SamplingParams, SGLangClient, SGLangServer, SGLangServerConfig
from agentrl.engine.recording import RecordingEngine
from agentrl.env import default_registry
from agentrl.errors import ConfigError, TrainerError
from agentrl.launcher.config import RunConfig, save_config
from agentrl.launcher.resources import make_env_resources, sft_traces_file, tasks_from
from agentrl.models import resolve_model
from agentrl.queue import TrajectoryQueue, WeightRegistry, connect_redis
from agentrl.tokenizer import ChatTokenizer
from agentrl.trainer.worker import registry_namespace, stream_name
from agentrl.types import Trajectory

logger = logging.getLogger(__name__)


class TrainerProcess:
    """The trainer as a child process (its own process group), logging into the run directory."""

    def __init__(self, run_dir: Path, env: dict[str, str]) -> None:
        self.run_dir = run_dir
        self.log_path = run_dir / "logs" / "trainer.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agentrl.trainer.worker", str(run_dir)], env={**os.environ, **env},
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    async def wait_ok(self, poll_s: float = 0.5) -> None:
        """Return when the trainer exits with 0; raise TrainerError (with its log) on any other exit."""
        while (code := self.proc.poll()) is None:
            await asyncio.sleep(poll_s)
        if code != 0:
            raise TrainerError(f"the trainer process exited with code {code}; {self.log_path} ends with:\n"
                               + self.log_tail())

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 15)
                self.proc.wait(timeout=timeout_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()


class RolloutLog:
    """Appends every queued trajectory to ``rollouts.jsonl``: in full (token arrays included) or a summary."""

    def __init__(self, path: Path, mode: str) -> None:
        self.path = path
        self.full = mode == "full"

    async def __call__(self, group: list[Trajectory]) -> None:
        with open(self.path, "a") as f:
            for t in group:
                if self.full:
                    record = t.to_dict()
                else:
                    record = {"trajectory_id": t.trajectory_id, "group_id": t.group_id, "reward": t.reward,
                              "finish_reason": t.finish_reason.value, "num_tokens": t.num_tokens,
                              "model_tokens": t.num_model_tokens, "versions": sorted(set(t.generated_versions)),
                              "turns": [{"text": u.text, "tools": [r.status for r in u.tool_results]}
                                        for u in t.turns]}
                f.write(json.dumps(record) + "\n")


def _summary(cfg: RunConfig, run_dir: Path, stats: Any, wall: float, served_version: int,
             engine_url: str) -> dict[str, Any]:
    records = []
    metrics_path = run_dir / "metrics.jsonl"
    if metrics_path.exists():
        records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    rewards = [r.get("reward_mean") for r in records]
    return {
        "run": cfg.name,
        "engine": "sglang",
        "engine_url": engine_url,
        "model": cfg.model,
        "steps": len(records),
        "final_weight_version": records[-1]["weight_version"] if records else 0,
        "served_weight_version": served_version,
        "trajectories_produced": stats.trajectories_queued,
        "trajectories_consumed": sum(int(r.get("num_trajectories", 0)) for r in records),
        "trajectories_dropped_stale": sum(int(r.get("dropped_stale", 0)) for r in records),
        "groups_failed": stats.groups_failed,
        "groups_filtered": stats.groups_filtered,
        "wall_time_s": round(wall, 2),
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "staleness_max": max((int(r.get("staleness_max", 0)) for r in records), default=0),
        "reload_s_mean": round(sum(stats.reload_s) / len(stats.reload_s), 3) if stats.reload_s else None,
        "rollout_model_tokens": stats.model_tokens,
    }


async def run_training(cfg: RunConfig) -> dict[str, Any]:
    """Run a whole training job as configured; returns (and writes) ``summary.json``."""
    cfg = cfg.with_default_name()
    run_dir = cfg.run_dir()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    if cfg.env.name not in {e.name for e in default_registry.list_envs()}:
        default_registry.get_env(cfg.env.name)  # raises ConfigError naming the known ones
    t_start = time.monotonic()
    base_model = resolve_model(cfg.model)
    tok = ChatTokenizer.from_pretrained(base_model)
    if cfg.sft.enabled and cfg.sft.steps > 0:
        sft_traces_file(cfg, tok, run_dir / "sft_traces.jsonl")

    async with AsyncExitStack() as stack:
        redis = await connect_redis(cfg.redis.url, run_dir / "redis")
        stack.push_async_callback(redis.aclose)
        trainer = TrainerProcess(run_dir, {"AGENTRL_REDIS_URL": redis.url})
        stack.callback(trainer.stop)
        server = await _start_engine(cfg, base_model, run_dir, stack)
        client = SGLangClient(server)
        stack.push_async_callback(client.aclose)
        engine: Any = client
        if cfg.engine.record_requests:
            engine = RecordingEngine(client, run_dir / "engine_requests.jsonl")
            stack.push_async_callback(engine.aclose)
        queue = TrajectoryQueue(redis.client, stream_name(cfg.name),
                                capacity=max(64, 4 * cfg.rollout.groups_per_step * cfg.rollout.n_samples))
        stack.push_async_callback(queue.aclose)
        registry = WeightRegistry(redis.client, registry_namespace(cfg.name))
        stack.push_async_callback(registry.aclose)
        resources = await make_env_resources(cfg, stack)

        v0 = await _race(registry.wait_for(0, timeout_s=3600), trainer)
        if Path(v0.path).resolve() != base_model.resolve():
            await client.update_weights(v0.path, 0)
        else:
            await client.set_weight_version(0)
        r = cfg.rollout
        runner = EpisodeRunner(
            engine, tok,
            SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p),
            EpisodeBudget(max_turns=r.max_turns, max_response_tokens=r.max_response_tokens,
                          max_context_tokens=r.max_context_tokens),
        )
        scheduler = RolloutScheduler(
            runner=runner, engine=client,
            make_env=lambda: default_registry.make_env(cfg.env.name, resources, **cfg.env.options),
            env_name=cfg.env.name, tasks=tasks_from(cfg.data.train, seed=cfg.seed), sink=queue, weights=registry,
            config=RolloutConfig(n_samples=r.n_samples, groups_per_step=r.groups_per_step,
                                 max_staleness=r.max_staleness, max_running_groups=r.max_running_groups,
                                 update_mode=r.update_mode, drop_uniform_groups=r.drop_uniform_groups),
            on_group=RolloutLog(run_dir / "rollouts.jsonl", cfg.log_rollouts) if cfg.log_rollouts != "none" else None,
        )
        stats = await _race(scheduler.run(total_groups=cfg.steps * r.groups_per_step, final_version=cfg.steps),
                            trainer)
        await trainer.wait_ok()
        served = await client.weight_version()
        summary = _summary(cfg, run_dir, stats, time.monotonic() - t_start, served, server)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    logger.info("run %s done: %s", cfg.name, summary)
    return summary


async def _start_engine(cfg: RunConfig, model: Path, run_dir: Path, stack: AsyncExitStack) -> str:
    if cfg.engine.url:
        return cfg.engine.url
    e = cfg.engine
    server = SGLangServer(
        SGLangServerConfig(model_path=str(model), device=e.device, dtype=e.dtype, max_total_tokens=e.max_total_tokens,
                           context_length=e.context_length, tp_size=e.tp_size, python=e.python or sys.executable,
                           startup_timeout_s=e.startup_timeout_s, extra_args=e.extra_args),
        log_path=run_dir / "logs" / "sglang.log",
    )
    stack.callback(server.stop)
    await asyncio.to_thread(server.start)
    return server.url


async def _race(coro: Any, trainer: TrainerProcess) -> Any:
    """Await ``coro`` unless the trainer process dies first (then raise its error instead of waiting forever)."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_watch(trainer))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        watch.result()
        raise TrainerError("the trainer process ended before the run was complete")
    finally:
        for t in (work, watch):
            t.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)


async def _watch(trainer: TrainerProcess) -> None:
    await trainer.wait_ok()



__all__ = ["run_training", "ConfigError"]
