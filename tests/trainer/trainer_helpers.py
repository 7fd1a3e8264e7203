"""Batches and spawned-process workers shared by the trainer tests (importable by spawned children)."""

from __future__ import annotations

import json
import os
import random
import socket
from pathlib import Path
from typing import Any

import torch

from agentrl.types import FinishReason, Trajectory


def make_traj(
    token_ids: list[int],
    prompt_len: int,
    loss_mask: list[int],
    *,
    reward: float = 0.0,
    group: str = "g",
    behav: list[float] | None = None,
    versions: list[int] | None = None,
    tid: str = "t",
    finish: FinishReason = FinishReason.STOP,
) -> Trajectory:
    n = len(token_ids)
    return Trajectory(
        trajectory_id=tid,
        prompt_id=group,
        group_id=group,
        token_ids=token_ids,
        prompt_len=prompt_len,
        loss_mask=loss_mask,
        behavior_logprobs=behav if behav is not None else [-1.0 * m for m in loss_mask],
        weight_versions=versions if versions is not None else [0 if m else -1 for m in loss_mask][:n],
        reward=reward,
        finish_reason=finish,
    )


def random_batch(
    seed: int, n: int = 12, group_size: int = 4, version: int = 0, vocab: int = 2000
) -> list[Trajectory]:
    """Multi-turn-looking trajectories: prompt, model tokens, a masked observation span, more model tokens."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, a, o, b = rng.randint(3, 9), rng.randint(2, 12), rng.randint(0, 6), rng.randint(1, 8)
        ids = [rng.randrange(10, vocab) for _ in range(p + a + o + b)]
        mask = [0] * p + [1] * a + [0] * o + [1] * b
        behav = [-rng.uniform(8.0, 13.0) if m else 0.0 for m in mask]  # near the tiny model's ~10.8 nats
        vers = [max(version - rng.randint(0, 1), 0) if m else -1 for m in mask]
        out.append(
            make_traj(
                ids,
                p,
                mask,
                reward=float(rng.random() < 0.5) + rng.random() * 0.1,
                group=f"s{seed}g{i // group_size}",
                behav=behav,
                versions=vers,
                tid=f"s{seed}t{i}",
            )
        )
    return out


def grouped_batch(seed: int, groups: int = 3, group_size: int = 4, vocab: int = 2000) -> list[Trajectory]:
    """GRPO-shaped trajectories: each group's members share a prompt and continue it differently (multi-turn
    looking: model tokens, a masked observation span, more model tokens; some responses a single token)."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(3, 12))]
        for i in range(group_size):
            a, o, b = rng.randint(1, 10), rng.randint(0, 5), rng.randint(0, 6) if i % 3 else 0
            resp = [rng.randrange(10, vocab) for _ in range(a + o + b)]
            mask = [0] * len(prompt) + [1] * a + [0] * o + [1] * b
            behav = [-rng.uniform(8.0, 13.0) if m else 0.0 for m in mask]
            out.append(make_traj(prompt + resp, len(prompt), mask, reward=float(rng.random() < 0.5),
                                 group=f"s{seed}g{g}", behav=behav, tid=f"s{seed}g{g}t{i}"))
    rng.shuffle(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_env(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)


def run_steps(rank: int, world: int, port: int, cfg_json: str, steps: int, out: str) -> None:
    """Worker: ``steps`` RL steps on fixed batches; rank 0 writes losses, norms and final logprobs as JSON."""
    from agentrl.trainer import Trainer, TrainerConfig

    init_env(rank, world, port)
    with Trainer(TrainerConfig.model_validate_json(cfg_json)) as tr:
        metrics = [tr.rl_step(random_batch(s, version=s), current_version=s).as_dict() for s in range(steps)]
        lp = tr.logprobs(random_batch(100))
        # one trace: with two ranks one of them holds only a dummy micro-batch, whose forward must still run (its
        # FSDP gathers are collectives the other rank's forward waits for)
        lp_one = tr.logprobs(random_batch(101, n=1))
        published = tr.full_state_dict()  # collective: gathered (and with LoRA merged) on rank 0
        if rank == 0:
            sums = {k: float(v.double().sum()) for k, v in published.items()}
            Path(out).write_text(json.dumps({"metrics": metrics, "logprobs": [x.tolist() for x in lp],
                                             "logprobs_one": [x.tolist() for x in lp_one],
                                             "world": tr.world_size, "published": sums}))


def run_with_checkpoint(cfg_json: str, ckpt: str, out: str, mode: str, port: int) -> None:
    """Worker for kill-and-resume. ``full``: steps 0..2, checkpoint after step 1, then SIGKILL itself.
    ``resume``: load the checkpoint in a fresh process and run step 2 only."""
    import signal

    from agentrl.trainer import Trainer, TrainerConfig

    init_env(0, 1, port)
    with Trainer(TrainerConfig.model_validate_json(cfg_json)) as tr:
        result: dict[str, Any] = {}
        if mode == "full":
            for s in range(2):
                tr.rl_step(random_batch(s, version=s), current_version=s)
            tr.save_checkpoint(ckpt, extra={"queue_position": "1700000000000-7", "consumed": 24})
        else:
            result["extra"] = tr.load_checkpoint(ckpt)
            result["restored"] = {"step": tr.step, "weight_version": tr.weight_version}
        m = tr.rl_step(random_batch(2, version=2), current_version=tr.weight_version)
        result["step3"] = m.as_dict()
        result["logprobs"] = [x.tolist() for x in tr.logprobs(random_batch(100))]
        result["rand"] = torch.rand(3).tolist()
        Path(out).write_text(json.dumps(result))
        if mode == "full":
            os.kill(os.getpid(), signal.SIGKILL)  # no clean shutdown: nothing may depend on one



def share_before_any_trainer(rank: int, world: int, port: int, out: str) -> None:
    """Worker: inside one ``process_group`` rank 0 shares an object before any Trainer exists (the launcher's
    trainer job does so with what it read from Redis); a group joined inside it (as each Trainer's does) neither
    owns nor destroys it; the outer one destroys it at the end."""
    import torch.distributed as dist

    from agentrl.trainer import broadcast_object, process_group

    init_env(rank, world, port)
    with process_group("cpu") as outer:
        got = broadcast_object({"from": "rank 0"} if rank == 0 else None)
        with process_group("cpu") as inner:  # SFT's trainer, say
            dist.barrier()
        alive = dist.is_initialized()
        dist.barrier()
        Path(f"{out}.{rank}").write_text(json.dumps({"got": got, "outer": outer.owns_group, "inner": inner.owns_group,
                                                     "alive": alive, "world": dist.get_world_size()}))
    Path(f"{out}.{rank}.after").write_text(json.dumps(dist.is_initialized()))


def hf_logprobs(model, token_ids: list[int], loss_mask: list[int]) -> torch.Tensor:
    """Plain HF: full logits, log_softmax, logprob of token t from position t - 1, 0 where unscored."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(token_ids[1:])[:, None]).squeeze(-1)
    out = torch.zeros(len(token_ids))
    mask = torch.tensor(loss_mask[1:], dtype=torch.bool)
    out[1:][mask] = lp[mask]
    return out
