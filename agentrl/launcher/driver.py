"""The single controller of a training run: it places the parts (on Ray, or in debug mode in its own process:
:mod:`agentrl.launcher.placement`), wires them, watches them, stops them.

    controller ── Redis (embedded in the run dir, or external) ──────────────────────────────┐
       │                                                                                      │
       ├─ TrainerActor × world size (SFT → v0, then RL steps v1..vN; restarted from its checkpoint if it dies)
       └─ RolloutActor (SGLang server, sandbox, rewards, RolloutScheduler) ─── trajectories ──┘

Data never passes through the controller: trajectories go rollout → Redis → trainer, weights go trainer →
``weights/v<N>/`` → SGLang (or, with ``weight_sync: distributed``, by broadcast; with ``tensor``, through shared
memory). It only starts things, waits on them, collects small summaries and writes the report. Every process
started is stopped at the end, also on Ctrl-C or an error (Ray actors with ``ray.kill``; the SGLang process groups
they started from the rollout node's ``logs/processes.jsonl``, by a task on that node:
:mod:`agentrl.launcher.ledger`).

Files: the controller shares the run directory with the trainer's ranks (it writes ``sft_traces.jsonl`` for
them, reads rank 0's ``metrics.jsonl`` and, for ``--resume``, their ``checkpoints/``, which every rank writes a
shard of): the trainer's node, or a volume shared by the trainer's nodes. The rollout side shares no directory
with either: what the controller needs from it comes back from its methods (Ray calls), and the held-out records
are written here (``eval_<label>.jsonl``; with ``data.heldout_every`` also during RL, ``eval_v<N>.jsonl``:
:mod:`agentrl.launcher.heldout_curve`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from agentrl.hardware import engine_dtype, resolve_dtype
from agentrl.launcher.colocation import PlacementChoice, hands_over_memory, resolve_placement
from agentrl.launcher.config import RunConfig, save_config
from agentrl.launcher.heldout_curve import MidRunEvals, Timeline, evaluating_during, forget_later_versions
from agentrl.launcher.memory import combine, controller_sampler
from agentrl.launcher.monitor import RunMonitor
from agentrl.launcher.placement import nodes, place
from agentrl.launcher.preflight import check_run
from agentrl.launcher.resources import sft_traces_file
from agentrl.launcher.rundir import ResumePoint, check_same_run, claim_run_dir
from agentrl.launcher.trackers import make_trackers
from agentrl.queue import connect_redis
from agentrl.tokenizer import ChatTokenizer

logger = logging.getLogger(__name__)


async def _first(coro: Any, trainers: Any) -> Any:
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


def resolve_precision(cfg: RunConfig) -> RunConfig:
    """``dtype: auto`` of the trainer and of the engine made concrete for this machine (agentrl.hardware), so
    ``config.yaml`` records what ran. A GPU trainer placed by Ray on another node keeps ``auto`` when this
    process sees no GPU: the trainer resolves it where it runs and logs the choice."""
    update: dict[str, Any] = {}
    device = cfg.trainer_device
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
    r = cfg.resources
    if not r.ray and (r.rollout_cores or r.trainer_cores):
        logger.warning("debug mode: one process for everything; resources.rollout_cores/trainer_cores ignored")
        cfg = cfg.model_copy(update={"resources": r.model_copy(update={"rollout_cores": None, "trainer_cores": None})})
    cfg, placement = resolve_placement(cfg)
    base_model = check_run(cfg)
    run_dir = cfg.run_dir().resolve()
    lock, point = claim_run_dir(run_dir, resume=resume, overwrite=overwrite)
    try:
        if point is not None:
            check_same_run(run_dir, cfg)
        return await _run(cfg, run_dir, base_model, point, placement)
    finally:
        lock.close()


async def _run(cfg: RunConfig, run_dir: Path, base_model: Path, point: ResumePoint | None,
               placement: PlacementChoice) -> dict[str, Any]:
    from agentrl.launcher.report import summarize, write_report

    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    t_start = time.monotonic()
    sft_data = None
    if cfg.sft.enabled and cfg.sft.steps > 0:
        sft_data = sft_traces_file(cfg, ChatTokenizer.from_pretrained(base_model), run_dir / "sft_traces.jsonl")
    evals = _saved_evals(run_dir) if point is not None else {}
    if point is not None and (dropped := forget_later_versions(
            evals, point.version, lambda label: (run_dir / f"eval_{label}.jsonl").unlink(missing_ok=True))):
        logger.info("resumed from v%d: the held-out evaluations %s are discarded (those versions are trained anew)",
                    point.version, ", ".join(dropped))
        _save_evals(run_dir, evals)
    async with AsyncExitStack() as stack:
        redis = await connect_redis(cfg.redis.url, run_dir / "redis")
        stack.push_async_callback(redis.aclose)
        memory = controller_sampler(redis.embedded.pid if redis.embedded is not None else None)
        stack.callback(memory.stop)
        carried = await _rewind(cfg, redis.client, point) if point is not None else 0
        rollout, trainers = await place(cfg, run_dir, redis.url, stack, memory)
        stack.push_async_callback(_aclose_rollout, rollout)
        engine_url = await _first(rollout.start(), trainers)
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
            if cfg.resources.placement == "colocated":  # the phases take turns: SFT (→ v0) first, then this eval
                await _first(rollout.wait_for_version(0), trainers)
            evals["before"] = await _first(_evaluate(rollout, "before", run_dir), trainers)
            _save_evals(run_dir, evals)
        if (heldout and "sft" not in evals) or point is None or point.version == 0:
            await _first(rollout.load_version(0), trainers)
        timeline = Timeline(t_start)
        start_version = point.version if point is not None else 0
        # the SFT policy's evaluation runs beside RL's first rollouts (on v0, which they generate with too: weight
        # loads wait for it), not before them. Colocated, the phases take turns: it runs first. So does a resumed
        # run's (interrupted during it), whose server loads the checkpoint's version after it
        sft_due = heldout and "sft" not in evals
        sft_beside_rl = sft_due and start_version == 0 and placement.placement != "colocated"
        if sft_due and start_version > 0 and cfg.weight_sync.mode != "disk":
            logger.warning("the sft held-out evaluation is not in evals.json and is skipped: v0 is no longer "
                           "published (weight_sync: %s keeps only the trainer's newest weights)", cfg.weight_sync.mode)
        elif sft_due and not sft_beside_rl:
            evals["sft"] = await _first(_evaluate(rollout, "sft", run_dir, timeline), trainers)
            _save_evals(run_dir, evals)
        if start_version > 0:  # the resumed trainer re-publishes it (re-exported if it was pruned)
            await _first(rollout.load_version(start_version), trainers)
        # groups the trainer still needs, less the complete groups waiting in the queue (carried from before)
        r = cfg.rollout.scheduler
        total_groups = max(0, (cfg.steps - start_version) * r.groups_per_step - carried // r.n_samples)
        t_rl = timeline.rl_start = time.monotonic()

        async def sft_eval() -> None:
            evals["sft"] = await _evaluate(rollout, "sft", run_dir, timeline, release_weights=True)
            _save_evals(run_dir, evals)

        if sft_beside_rl:
            await _first(rollout.hold_weights(), trainers)
        async with evaluating_during(_mid_run_evals(cfg, rollout, run_dir, evals, timeline, start_version)):
            rollout_stats = await _first(_beside(rollout.run(total_groups, cfg.steps),
                                                 sft_eval() if sft_beside_rl else None), trainers)
        await trainers.wait()
        rl_wall_s = time.monotonic() - t_rl
        await rollout.trainer_finished(cfg.steps)  # servers restarted from here on cannot ask the trainer
        if heldout:
            evals["after"] = await _evaluate(rollout, "after", run_dir, timeline)
            _save_evals(run_dir, evals)
        served = await rollout.weight_version()
        left = await rollout.queue_length()
        monitor.update(await rollout.progress())
        summary = summarize(cfg, run_dir, rollout_stats=rollout_stats, evals=evals, served_version=served,
                            engine_url=engine_url, queue_left=left, trainer_restarts=trainers.restarts,
                            wall_time_s=time.monotonic() - t_start,
                            resumed_from_step=point.step if point is not None else None, carried_in=carried)
        summary["metrics_url"] = monitor.metrics_url
        summary["nodes"] = await nodes(rollout, trainers)
        summary["placement"] = {**placement.as_dict(), "applied": {**await rollout.applied_placement(),
                                                                   "trainer": _trainer_placement(run_dir)}}
        if sft_data is not None:
            summary["sft_data"] = sft_data.as_dict()  # traces, tokens, truncated (never dropped)
        summary["rl_wall_s"] = round(rl_wall_s, 2)
        memory.stop()
        summary["memory"] = combine([memory.report(), await rollout.memory_report(), *trainers.memory_reports])
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


async def _beside(run: Awaitable[Any], other: Awaitable[None] | None) -> Any:
    """``run``'s result, with ``other`` (None: nothing) running beside it and awaited too; if either fails, the
    other is cancelled and the error raised."""
    if other is None:
        return await run
    tasks = [asyncio.ensure_future(other), asyncio.ensure_future(run)]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return tasks[1].result()


async def _evaluate(rollout: Any, label: str, run_dir: Path, timeline: Timeline | None = None, *,
                    release_weights: bool = False) -> dict[str, Any]:
    """A held-out evaluation on the rollout side; its records come back to be written here. With ``timeline``,
    the figures carry the evaluation's start (as every point of the held-out curve does). ``release_weights``: it
    ends the hold ``rollout.hold_weights()`` took (``RolloutWorker.evaluate_heldout``)."""
    from agentrl.launcher.heldout import write_records

    stamp = timeline.stamp() if timeline is not None else {}
    figures, records = await rollout.evaluate_heldout(label, release_weights=release_weights)
    write_records(run_dir / f"eval_{label}.jsonl", records)
    return {**figures, **stamp}


def _mid_run_evals(cfg: RunConfig, rollout: Any, run_dir: Path, evals: dict[str, Any], timeline: Timeline,
                   start_version: int) -> MidRunEvals | None:
    """The held-out evaluations during RL (``data.heldout_every``; :mod:`agentrl.launcher.heldout_curve`)."""
    from agentrl.launcher.heldout import write_records

    d = cfg.data
    if d.heldout_every == 0 or d.num_heldout == 0:
        return None
    if hands_over_memory(cfg):  # SGLang gives its GPU memory to every trainer step: an evaluation would wait on it
        logger.warning("data.heldout_every is ignored with a colocated GPU engine: held-out evaluations run before "
                       "and after RL only")
        return None
    return MidRunEvals(rollout, every=d.heldout_every, final_version=cfg.steps, evals=evals,
                       save=lambda: _save_evals(run_dir, evals),
                       write=lambda label, records: write_records(run_dir / f"eval_{label}.jsonl", records),
                       timeline=timeline, start_version=start_version)


def _trainer_placement(run_dir: Path) -> dict[str, Any] | None:
    """The cores and torch threads trainer rank 0 ran with (it records them in ``logs/``; None if it did not,
    e.g. on another node without a shared run directory)."""
    path = run_dir / "logs" / "trainer-0.placement.json"
    return json.loads(path.read_text()) if path.exists() else None


def _saved_evals(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "evals.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _save_evals(run_dir: Path, evals: dict[str, Any]) -> None:
    (run_dir / "evals.json").write_text(json.dumps(evals, indent=2))


async def _aclose_rollout(rollout: Any) -> None:
    try:
        await asyncio.wait_for(rollout.aclose(), 30)
    except Exception as exc:  # a Ray actor may be dead already; the ledger kill still runs
        logger.debug("rollout close: %r", exc)
