"""Trainer throughput: agentrl's Trainer.rl_step vs a minimal hand-written FSDP2 loop, same model, same batch.

Both sides: FSDP2 (``fully_shard`` per decoder layer, then the root) over gloo at world size 1, fp32, AdamW,
gradient clipping at 1.0, the PPO clipped surrogate against the engine's behaviour logprobs (agentrl's
``correction: none``, one forward/backward per micro-batch) with token-mean aggregation. The minimal loop is
what one writes by hand: pad the batch, full logits, ``log_softmax``, gather, masked mean, backward, step.
The batch is RL-shaped: variable-length multi-turn trajectories with a masked observation span.
Rounds alternate between the two so that load from other processes hits both alike; tokens/s use each
side's fastest round (the least disturbed), and the process CPU-time ratio is printed as a cross-check.

Usage: ``python benchmarks/trainer_bench.py [--model smollm2-135m-instruct|tiny] [--rounds 4] [--threads 1]``
Last line: ``trainer_vs_minimal_ratio=… trainer_tokens_per_s=… minimal_tokens_per_s=… cpu_time_ratio=…``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from agentrl.models import resolve_model
from agentrl.trainer import LossConfig, OptimizerConfig, Trainer, TrainerConfig
from agentrl.types import FinishReason, Trajectory


def make_batch(n: int, seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, a, o, b = rng.randint(24, 48), rng.randint(24, 96), rng.randint(8, 24), rng.randint(8, 48)
        ids = [rng.randrange(100, 40000) for _ in range(p + a + o + b)]
        mask = [0] * p + [1] * a + [0] * o + [1] * b
        out.append(
            Trajectory(
                trajectory_id=str(i),
                prompt_id=str(i // 4),
                group_id=str(i // 4),
                token_ids=ids,
                prompt_len=p,
                loss_mask=mask,
                behavior_logprobs=[-rng.uniform(5, 12) if m else 0.0 for m in mask],
                weight_versions=[0 if m else -1 for m in mask],
                reward=float(rng.random() < 0.5),
                finish_reason=FinishReason.STOP,
            )
        )
    return out


class MinimalLoop:
    """The hand-written baseline: padded batch, full logits, PPO-clip token mean."""

    def __init__(self, path: str, batch: list[Trajectory], lr: float) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        mesh = init_device_mesh("cpu", (1,))
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)
        width = max(t.num_tokens for t in batch)
        self.ids = torch.zeros(len(batch), width, dtype=torch.long)
        self.attn = torch.zeros(len(batch), width, dtype=torch.long)
        self.mask = torch.zeros(len(batch), width - 1)
        self.behav = torch.zeros(len(batch), width - 1)
        rewards = torch.tensor([t.reward for t in batch])
        groups = torch.tensor([int(t.group_id) for t in batch])
        adv = torch.zeros(len(batch))
        for g in groups.unique():
            sel = groups == g
            adv[sel] = (rewards[sel] - rewards[sel].mean()) / (rewards[sel].std() + 1e-6)
        for i, t in enumerate(batch):
            n = t.num_tokens
            self.ids[i, :n] = torch.tensor(t.token_ids)
            self.attn[i, :n] = 1
            self.mask[i, : n - 1] = torch.tensor(t.loss_mask[1:], dtype=torch.float32)
            self.behav[i, : n - 1] = torch.tensor(t.behavior_logprobs[1:])
        self.adv = adv[:, None]

    def step(self) -> float:
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(input_ids=self.ids, attention_mask=self.attn).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, self.ids[:, 1:, None]).squeeze(-1)
        ratio = torch.exp(logp - self.behav)
        pg = torch.max(-self.adv * ratio, -self.adv * ratio.clamp(0.8, 1.28))
        loss = (pg * self.mask).sum() / self.mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return float(loss.detach())


def timed(fn) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(wall seconds, process CPU seconds) of one call."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)  # 2 cores shared: 1 avoids OMP stalls
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = str(resolve_model(args.model))
    batch = make_batch(args.batch)
    tokens = sum(t.num_tokens for t in batch)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    lr = 1e-6
    cfg = TrainerConfig(
        model=path,
        optimizer=OptimizerConfig(lr=lr, grad_clip=1.0),
        loss=LossConfig(correction="none", advantage="grpo"),
        micro_batch_tokens=16384,
    )
    trainer = Trainer(cfg)
    minimal = MinimalLoop(path, batch, lr)
    version = 0

    def trainer_step() -> None:
        nonlocal version
        trainer.rl_step(batch, current_version=version)
        version += 1

    trainer_step(), minimal.step()  # warm-up (allocator, kernels)
    runs: dict[str, list[tuple[float, float]]] = {"minimal": [], "trainer": []}
    for r in range(args.rounds):  # ABBA order: neither side always runs first
        order = ("minimal", "trainer") if r % 2 == 0 else ("trainer", "minimal")
        for k in order:
            runs[k].append(timed(minimal.step if k == "minimal" else trainer_step))
    best = {k: min(w for w, _ in v) for k, v in runs.items()}  # least disturbed by other processes
    cpu = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
    print(
        f"model={args.model} world_size=1 dtype=fp32 threads={args.threads} trajectories={len(batch)} "
        f"tokens/step={tokens} padded_tokens/step={minimal.ids.numel()}"
    )
    for k, v in runs.items():
        print(f"{k:<8} per-round wall s: {[round(w, 2) for w, _ in v]}  cpu s: {[round(c, 2) for _, c in v]}")
    print(f"{'loop':<22}{'best wall s':>12}{'tokens/s':>10}{'median cpu s':>14}{'tokens/cpu-s':>14}")
    for k, name in (("minimal", "minimal FSDP2 loop"), ("trainer", "agentrl Trainer")):
        print(f"{name:<22}{best[k]:>12.3f}{tokens / best[k]:>10.1f}{cpu[k]:>14.3f}{tokens / cpu[k]:>14.1f}")
    tr_tps, min_tps = tokens / best["trainer"], tokens / best["minimal"]
    trainer.close()
    dist.destroy_process_group()
    print(
        f"trainer_vs_minimal_ratio={tr_tps / min_tps:.3f} trainer_tokens_per_s={tr_tps:.1f} "
        f"minimal_tokens_per_s={min_tps:.1f} cpu_time_ratio={cpu['minimal'] / cpu['trainer']:.3f}"
    )


if __name__ == "__main__":
    main()
