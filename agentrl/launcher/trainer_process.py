"""The trainer process of a run: cold-start SFT (optional), then RL steps on trajectories from the Redis queue.

The controller runs :func:`train` on one Ray actor per rank (or, in debug mode, on a thread of its own process);
``python -m agentrl.launcher.trainer_process RUN_DIR`` runs it as a plain process from ``RUN_DIR/config.yaml``.
Rank 0 talks to Redis and shares each batch with the other ranks; every rank runs the same FSDP2 steps. Per RL
step k (1-based):

    read complete groups → rl_step (version k-1 → k) → export weights/v<k> → checkpoint (with the entry ids
    of the step) → ack those ids → publish v<k> in the weight registry → append metrics.jsonl

Exactly-once: an entry is acked only after the checkpoint that includes its step is on disk; a restarted trainer
first acks the ids recorded in its last checkpoint, so a crash between checkpoint and ack never trains an entry
twice, and a crash before the checkpoint leaves the entries pending, to be trained on by the resumed run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from agentrl.data.sft import read_traces
from agentrl.launcher.config import RunConfig, load_config
from agentrl.launcher.cores import CoreBorrower, TrainerWaitFlag, engine_borrow_flag, idle_key, redis_idle_probe
from agentrl.launcher.protocol import queue_capacity, read_groups, registry_namespace, stream_name
from agentrl.models import resolve_model
from agentrl.queue import TrajectoryQueue, WeightRegistry, connect_redis
from agentrl.queue.base import QueueEntry
from agentrl.queue.weight_sync import SyncChannel
from agentrl.trainer import Trace, Trainer, broadcast_object, latest_checkpoint, process_group
from agentrl.trainer.storage import intact_hf_folder, prune_checkpoints
from agentrl.trainer.weight_sync import WeightSender, WeightServer, address_toward
from agentrl.types import Trajectory

logger = logging.getLogger(__name__)


def load_traces(path: Path) -> list[Trace]:
    return [Trace(token_ids=t.token_ids, loss_mask=t.loss_mask) for t in read_traces(path)]


def run_sft(cfg: RunConfig, run_dir: Path, base_model: Path, borrower: CoreBorrower | None = None) -> Path:
    """Cold-start SFT on ``run_dir/sft_traces.jsonl``; exports and returns ``weights/v0``."""
    traces = load_traces(run_dir / "sft_traces.jsonl")
    optimizer = cfg.trainer.optimizer.model_copy(update={"lr": cfg.sft.lr, "warmup_steps": 0, "schedule": "constant",
                                                         "total_steps": None})
    # SFT's loss is the NLL alone: no reference model is loaded for it (kl_coef 0), a model's size of RAM saved
    loss = cfg.trainer.loss.model_copy(update={"kl_coef": 0.0})
    tcfg = cfg.trainer.model_copy(update={"optimizer": optimizer, "loss": loss}).for_model(str(base_model))
    target = run_dir / "weights" / "v0"
    try:
        with Trainer(tcfg) as sft, open(run_dir / "sft_metrics.jsonl", "a") as out:
            sft.before_micro_batch = borrower.adjust if borrower is not None else None
            bs = cfg.sft.batch_size
            for step in range(cfg.sft.steps):
                start = (step * bs) % len(traces)
                batch = (traces + traces)[start : start + bs]
                m = sft.sft_step(batch)
                if sft.rank == 0:
                    borrowed = {"cores_borrowed_share": borrower.take_share()} if borrower is not None else {}
                    out.write(json.dumps({**m.as_dict(), **borrowed}) + "\n")
                    out.flush()
                    if step % 10 == 0 or step == cfg.sft.steps - 1:
                        logger.info("sft step %d/%d loss %.4f", step + 1, cfg.sft.steps, m.loss)
            sft.export_hf(target, torch.float32)  # v0 stays fp32 (a LoRA run's bf16 base merged with fp32 adapters)
    finally:
        if borrower is not None:  # SFT's thread count is its own: the RL trainer starts from its own cores
            borrower.close()
    return target


def append_metrics(run_dir: Path, record: dict[str, Any]) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


class _Rank0:
    """What only rank 0 does: Redis (queue reads, acks, registry), metrics files."""

    def __init__(self, cfg: RunConfig, queue: TrajectoryQueue, registry: WeightRegistry, redis_url: str) -> None:
        self.cfg, self.queue, self.registry, self.redis_url = cfg, queue, registry, redis_url
        self.carry: dict[str, list[QueueEntry]] = {}
        self.unacked: list[str] = []  # entries trained on since the last checkpoint
        self.borrower: CoreBorrower | None = None  # resources.trainer_borrows_idle_cores
        self.published = -1  # the newest version this trainer published (the borrower's test of a waiting rollout)
        self.wait_flag: TrainerWaitFlag | None = None  # resources.engine_borrows_idle_cores


_ENGINE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                  "half": torch.float16}


class WeightShare:
    """How this run's weight versions reach the servers (``weight_sync.mode``). :meth:`share` is collective.

    disk: each version is exported to ``weights/v<N>`` in the engine's dtype (``v0``, SFT's output and the RL trainer's
    start, stays fp32). distributed: rank 0 keeps the newest version in memory
    (cast to the engine's dtype: the servers cast it so anyway) and a :class:`WeightServer` thread broadcasts it
    whenever the rollout side asks (a new version, or a restarted server); nothing is written unless the rollout
    side falls back to disk, and the final version at the end of the run (:meth:`finish`). tensor: the same, the
    memory shared (``/dev/shm``) and named to the servers instead of broadcast."""

    def __init__(self, cfg: RunConfig, run_dir: Path, trainer: Trainer, r0: _Rank0 | None) -> None:
        self.trainer, self.cfg = trainer, cfg
        ws = cfg.weight_sync
        self.mode = ws.mode
        self.distributed = ws.mode != "disk"  # held in memory (distributed or tensor)
        self.dtype = _ENGINE_DTYPES.get(cfg.engine.server.dtype)
        self.server: WeightServer | None = None
        self.export_dir = run_dir / "weights"
        if self.distributed and r0 is not None:
            device = trainer.device
            backend = ws.backend if ws.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
            address = ws.address or address_toward(urlparse(r0.redis_url).hostname or "127.0.0.1")
            sender = WeightSender(address=address, backend=backend, bucket_bytes=int(ws.bucket_mb * 2**20),
                                  timeout_s=ws.timeout_s, device=device if backend == "nccl" else None,
                                  shared_memory=ws.mode == "tensor")
            url, namespace = r0.redis_url, registry_namespace(cfg.name)

            async def connect() -> SyncChannel:
                return SyncChannel.connect(url, namespace)

            self.server = WeightServer(sender, connect, export_dir=self.export_dir,
                                       write=lambda sd, path: trainer.write_hf(dict(sd), path)).start()
            logger.info("weight sync: %s (%s), servers connect to %s", ws.mode, backend, address)

    @property
    def transport(self) -> str:
        return self.mode

    def share(self, version: int, target: Path) -> None:
        """Make ``version`` (the trainer's current weights) available: written to ``target``, or held for
        broadcasts. Every rank calls it."""
        if not self.distributed:
            # a cache for SGLang (a resume re-exports it), in the dtype it serves: half the bytes in bf16, the same
            # values (SGLang casts an fp32 file to its dtype with the same rounding); checkpoints keep fp32
            self.trainer.export_hf(target, self.dtype, durable=False)
            return
        sd = self.trainer.full_state_dict()
        if self.server is not None:
            self.server.sender.set_weights(version, sd, self.dtype)

    def finish(self, final_version: int) -> None:
        """After the last step: answer until the rollout side serves ``final_version`` (bounded by how long its
        last load may take: each attempt's ask, then the fallback's), then write it to ``weights/v<N>`` (in the
        engine's dtype, unless a fallback export already did): the run leaves a model a server can load, and a
        SGLang server restarted after this process has ended loads it from there (the rollout side's
        ``trainer_finished``). Rank 0 of a distributed or tensor sync; a no-op elsewhere."""
        if self.server is None:
            return
        ws = self.cfg.weight_sync
        self.server.finish(final_version, timeout_s=(ws.attempts + 1) * (2 * ws.timeout_s + 30.0))
        version, tensors = self.server.sender.snapshot()
        path = self.export_dir / f"v{version}"
        if not intact_hf_folder(path):
            self.trainer.write_hf(dict(tensors), path, durable=True)
        logger.info("final weights v%d written to %s", version, path)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


async def train(cfg: RunConfig, run_dir: Path, redis_url: str | None, *, rank: int = 0) -> None:
    """The whole trainer job of one rank (SPMD: every rank runs this; rank 0 also talks to Redis at
    ``redis_url``, or to an embedded server in the run directory). The ranks join one process group first: rank 0
    shares what it read from Redis before any model is built."""
    with process_group(cfg.trainer.device):
        await _train(cfg, run_dir, redis_url, rank=rank)


async def _train(cfg: RunConfig, run_dir: Path, redis_url: str | None, *, rank: int) -> None:
    base_model = resolve_model(cfg.model)
    r0: _Rank0 | None = None
    handle = None
    if rank == 0:
        handle = await connect_redis(redis_url, run_dir / "redis")
        queue = TrajectoryQueue(handle.client, stream_name(cfg.name), consumer="trainer-0",
                                capacity=queue_capacity(cfg))
        r0 = _Rank0(cfg, queue, WeightRegistry(handle.client, registry_namespace(cfg.name)), handle.url)
        if cfg.resources.trainer_borrows_idle_cores is True and cfg.resources.trainer_world_size == 1:
            r = cfg.resources
            r0.borrower = CoreBorrower(r.trainer_cores or [], r.rollout_cores or [],
                                       redis_idle_probe(handle.url, idle_key(cfg.name), lambda: r0.published))
            logger.info("trainer borrows the rollout cores %s while the rollout side is idle", r.rollout_cores)
        if cfg.resources.engine_borrows_idle_cores is True and cfg.resources.trainer_world_size == 1:
            r0.wait_flag = TrainerWaitFlag(engine_borrow_flag(run_dir))
            logger.info("SGLang may use the trainer cores %s while the trainer waits (%s)",
                        cfg.resources.trainer_cores, r0.wait_flag.path)
    try:
        ckpt = latest_checkpoint(run_dir / "checkpoints")
        need_v0 = ckpt is None and (r0 is None or await r0.registry.latest() is None)
        publish_v0 = broadcast_object(need_v0 if r0 is not None else None)
        sft = cfg.sft.enabled and cfg.sft.steps > 0
        if publish_v0:
            v0_path = run_sft(cfg, run_dir, base_model, r0.borrower if r0 else None) if sft else base_model
            if r0 is not None and not sft:
                await r0.registry.publish(0, str(v0_path), step=0, metrics={}, transport="base")
                r0.published = 0
                logger.info("published v0: the base model %s", v0_path)
        policy = run_dir / "weights" / "v0" if (run_dir / "weights" / "v0" / "config.json").exists() else base_model
        with Trainer(cfg.trainer.for_model(str(policy))) as trainer:
            _record_placement(run_dir, rank, r0.borrower if r0 else None)
            if r0 is not None and r0.borrower is not None:
                trainer.before_micro_batch = r0.borrower.adjust
            weights = WeightShare(cfg, run_dir, trainer, r0)
            try:
                if ckpt is not None:
                    extra = trainer.load_checkpoint(ckpt)
                    current = run_dir / "weights" / f"v{trainer.weight_version}"
                    if weights.distributed:
                        weights.share(trainer.weight_version, current)
                    elif trainer.weight_version > 0 and not broadcast_object(intact_hf_folder(current) if r0 else None):
                        trainer.export_hf(current, weights.dtype)  # not fsynced when published: a crash may have cut it
                    if r0 is not None:
                        await r0.queue.ack(extra.get("entry_ids", []))  # idempotent: finishes an interrupted ack
                        await _republish(r0, run_dir, trainer.weight_version, trainer.step, weights.transport)
                        _truncate_metrics(run_dir, trainer.step)
                    logger.info("resumed from %s at step %d, version %d", ckpt, trainer.step, trainer.weight_version)
                elif weights.distributed:  # v0 (or the version the registry has) is served from memory too
                    weights.share(trainer.weight_version, run_dir / "weights" / "v0")
                if publish_v0 and sft and r0 is not None:  # after the share: a broadcast of v0 can be served now
                    await r0.registry.publish(0, str(run_dir / "weights" / "v0"), step=0, metrics={},
                                              transport=weights.transport)
                    r0.published = 0
                    logger.info("published v0 (%s)", weights.transport)
                while trainer.weight_version < cfg.steps:
                    await rl_step(cfg, run_dir, trainer, r0, weights)
                await asyncio.to_thread(weights.finish, trainer.weight_version)
            finally:
                weights.close()
    finally:
        if r0 is not None:
            if r0.wait_flag is not None:
                r0.wait_flag.lower()
            if r0.borrower is not None:
                r0.borrower.close()
            await r0.queue.aclose()
            await r0.registry.aclose()
        if handle is not None:
            await handle.aclose()


def _record_placement(run_dir: Path, rank: int, borrower: CoreBorrower | None = None) -> None:
    """Log and record (``logs/trainer-<rank>.placement.json``) the cores and torch threads this rank runs with:
    what ``resources.placement`` gave it, as applied (:mod:`agentrl.launcher.colocation`), and the cores it
    borrows while the rollout side is idle (:mod:`agentrl.launcher.cores`)."""
    own = borrower.own if borrower is not None else sorted(os.sched_getaffinity(0))
    threads = torch.get_num_threads() - (len(borrower.lend) if borrower is not None and borrower.borrowing else 0)
    placed = {"rank": rank, "pid": os.getpid(), "cores": own, "torch_threads": threads,
              "borrows_cores": borrower.lend if borrower is not None else []}
    logger.info("trainer rank %d: cores %s, %d torch threads%s", rank, placed["cores"], placed["torch_threads"],
                f"; also cores {borrower.lend} while the rollout side is idle" if borrower is not None else "")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "logs" / f"trainer-{rank}.placement.json").write_text(json.dumps(placed))


def _truncate_metrics(run_dir: Path, step: int) -> None:
    """Steps after the checkpoint are trained again after a restart: drop their old metric lines."""
    path = run_dir / "metrics.jsonl"
    if path.exists():
        keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in keep))


def prune_weight_versions(cfg: RunConfig, run_dir: Path, latest: int) -> None:
    """Delete published versions older than the last ``keep_weight_versions`` (v0 stays: a resume starts from
    it). The rollout side loads a version within η + 1 of the trainer's, and a restarted SGLang server loads the
    latest one, so only the newest few are ever read again."""
    keep = cfg.keep_weight_versions
    if keep is None:
        return
    root = run_dir / "weights"
    for old in root.glob("v*") if root.is_dir() else ():
        if old.name[1:].isdigit() and 0 < int(old.name[1:]) <= latest - keep:
            shutil.rmtree(old, ignore_errors=True)


async def _republish(r0: _Rank0, run_dir: Path, version: int, step: int, transport: str) -> None:
    """After a restart the checkpointed version may not have reached the registry (crash before publish)."""
    latest = await r0.registry.latest()
    if version > 0 and (latest is None or latest.version < version):
        await r0.registry.publish(version, str(run_dir / "weights" / f"v{version}"), step=step, metrics={},
                                  transport=transport)
    r0.published = max(version, latest.version if latest is not None else -1)


async def rl_step(cfg: RunConfig, run_dir: Path, trainer: Trainer, r0: _Rank0 | None, weights: WeightShare) -> None:
    t0 = time.monotonic()
    entries: list[QueueEntry] = []
    if r0 is not None:
        with r0.wait_flag.raised() if r0.wait_flag is not None else contextlib.nullcontext():
            entries = await read_groups(r0.queue, groups=cfg.rollout.scheduler.groups_per_step,
                                        group_size=cfg.rollout.scheduler.n_samples,
                                        carry=r0.carry, stop_after_s=3600)
    wait_s = time.monotonic() - t0
    batch: list[Trajectory] = broadcast_object([e.trajectory for e in entries] if r0 is not None else None)
    m = trainer.rl_step(batch, current_version=trainer.weight_version)
    if r0 is not None and r0.borrower is not None:
        r0.borrower.close()  # the export and publication on our own cores: the rollout side wakes up meanwhile
    new_version = trainer.weight_version
    target = run_dir / "weights" / f"v{new_version}"
    weights.share(new_version, target)
    if r0 is not None:
        r0.unacked += [e.entry_id for e in entries]
    if new_version % cfg.checkpoint_every == 0 or new_version == cfg.steps:
        ids = broadcast_object(list(r0.unacked) if r0 is not None else None)
        trainer.save_checkpoint(run_dir / "checkpoints" / f"step-{trainer.step:06d}", extra={"entry_ids": ids})
        if r0 is not None:
            await r0.queue.ack(ids)  # only now: the checkpoint that includes these steps is on disk
            r0.unacked.clear()
            prune_checkpoints(run_dir / "checkpoints", cfg.keep_checkpoints)
    if r0 is None:
        return
    record = {**m.as_dict(), "step": trainer.step, "weight_version": new_version, "wait_s": wait_s,
              "time_s": time.monotonic() - t0, "wall_time": time.time()}
    if r0.borrower is not None:  # share of this step's micro-batches run on the rollout side's cores too
        record["cores_borrowed_share"] = r0.borrower.take_share()
    await r0.registry.publish(new_version, str(target), step=trainer.step,
                              metrics={"reward_mean": m.reward_mean, "loss": m.loss}, transport=weights.transport)
    r0.published = new_version
    append_metrics(run_dir, record)
    prune_weight_versions(cfg, run_dir, new_version)
    logger.info("step %d → v%d reward %.3f trajs %d tokens %d staleness %.2f (%.1fs, waited %.1fs)",
                trainer.step, new_version, m.reward_mean, m.num_trajectories, m.tokens, m.staleness_mean,
                record["time_s"], wait_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="agentrl trainer process (RANK, AGENTRL_REDIS_URL and torch's "
                                                 "distributed variables from the environment)")
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cfg = load_config(args.run_dir / "config.yaml")
    asyncio.run(train(cfg, args.run_dir, os.environ.get("AGENTRL_REDIS_URL"), rank=int(os.environ.get("RANK", "0"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
