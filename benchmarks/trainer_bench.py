"""Trainer throughput: agentrl's Trainer.rl_step vs a minimal hand-written FSDP2 loop, same model, same batch.

Both sides: FSDP2 (``fully_shard`` per decoder layer, then the root) over gloo at world size 1, fp32, AdamW,
gradient clipping at 1.0, the PPO clipped surrogate against the engine's behaviour logprobs (agentrl's
``correction: none``, one forward/backward per micro-batch) with token-mean aggregation. The minimal loop is
what one writes by hand: pad the batch, full logits, ``log_softmax``, gather, masked mean, backward, step.
The batch is RL-shaped: variable-length multi-turn trajectories with a masked observation span.
Rounds alternate between the two so that load from other processes hits both alike; tokens/s use each
side's fastest round (the least disturbed), and the process CPU-time ratio is printed as a cross-check.

``--shape demo`` builds the demo's RL step instead: ``--groups`` groups of ``--group-size`` responses sharing one
~86-token prompt, ~146 tokens a trajectory (6 x 8 = 48 trajectories, ~7,000 tokens, as ``agentrl demo``), and
``--layout``, ``--kl-coef``, ``--micro-batch-tokens``, ``--logits-chunk-tokens`` and ``--activation-checkpointing``
set the trainer as a recipe would (``--no-minimal`` times the trainer alone).

Memory: ``trainer_peak_rss_gb`` is the process's ``VmHWM`` after building the Trainer and running two RL steps,
before the minimal loop exists (so it is the trainer's peak: weights, gradients, AdamW state, reference model,
activations, logits, allocator); with ``--no-minimal`` it covers every step. ``trainer_mfu``: the model FLOPs of
a step (6 x decoder matmul parameters x input tokens + 6 x hidden x vocab x scored tokens + attention, 2/6 of
that for no-grad passes; recomputation not counted) per second of the round with the least process CPU time
divided by the thread count (the machine is shared: other processes stretch wall time, not the work done), over
the fp32 matmul rate of this process measured in the same run with the same thread count, before and after the
rounds, by CPU time too (``[2048, hidden] x [hidden, intermediate]``, the shape of a decoder MLP).

``--lora`` trains LoRA adapters instead of the full model (``trainer.lora``: ``--lora-r``, alpha 2r, every linear
of the decoder; the reference is then the policy with its adapters off, no second model): compare its
``trainer_peak_rss_gb`` and ``trainer_step_s`` with the same command without it. Its ``trainer_mfu`` counts 2 passes, not 3, for a
step's forward and backward (the frozen base gets no weight gradients: forward + input gradients; the adapters' own
FLOPs are left out).

Usage: ``python benchmarks/trainer_bench.py [--model smollm2-135m-instruct|tiny] [--rounds 4] [--threads 1]``
Last line: ``trainer_vs_minimal_ratio=… trainer_tokens_per_s=… minimal_tokens_per_s=… cpu_time_ratio=…
trainer_step_s=… trainer_peak_rss_gb=… trainer_mfu=… trainer_cpu_s=… lora=0|1 cpu=…`` (``trainer_cpu_s``: the
median process CPU seconds of a trainer step).
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from agentrl.models import resolve_model
from agentrl.trainer import Trainer, TrainerConfig
from agentrl.types import FinishReason, Trajectory


def make_batch(n: int, seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, a, o, b = rng.randint(24, 48), rng.randint(24, 96), rng.randint(8, 24), rng.randint(8, 48)
        ids = [rng.randrange(100, 40000) for _ in range(p + a + o + b)]
        mask = [0] * p + [1] * a + [0] * o + [1] * b
        out.append(
            _trajectory(rng, str(i), str(i // 4), ids, p, mask)
        )
    return out



def _trajectory(rng: random.Random, tid: str, group: str, ids: list[int], prompt_len: int,
                mask: list[int]) -> Trajectory:
    """A trajectory of the bench's batches: random behaviour logprobs on scored tokens, a coin-flip reward."""
    return Trajectory(trajectory_id=tid, prompt_id=group, group_id=group, token_ids=ids, prompt_len=prompt_len,
                      loss_mask=mask, behavior_logprobs=[-rng.uniform(5, 12) if m else 0.0 for m in mask],
                      weight_versions=[0 if m else -1 for m in mask], reward=float(rng.random() < 0.5),
                      finish_reason=FinishReason.STOP)

def make_demo_batch(groups: int, group_size: int, seed: int = 0) -> list[Trajectory]:
    """The demo's RL step: each group's responses continue one shared prompt (what ``shared_prefix`` exploits)."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(76, 96))]
        for k in range(group_size):
            a, o, b = rng.randint(24, 40), rng.randint(8, 16), rng.randint(8, 24)
            ids = prompt + [rng.randrange(100, 40000) for _ in range(a + o + b)]
            mask = [0] * len(prompt) + [1] * a + [0] * o + [1] * b
            out.append(_trajectory(rng, f"{g}-{k}", str(g), ids, len(prompt), mask))
    return out


def peak_rss_gb() -> float:
    """``VmHWM`` of this process (Linux), in GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip().replace(" ", "_")
    return platform.processor() or "unknown"


def matmul_flops(hidden: int, inter: int, threads: int, reps: int = 30) -> float:
    """fp32 FLOP/s per core of ``[2048, hidden] @ [hidden, inter]`` in this process: the best of ``reps`` by
    process CPU time / ``threads`` (another process time-slicing the core stretches wall time, not CPU time)."""
    a, b = torch.randn(2048, hidden), torch.randn(hidden, inter)
    a @ b
    best = math.inf
    for _ in range(reps):
        t = time.process_time()
        a @ b
        best = min(best, (time.process_time() - t) / threads)
    return 2 * 2048 * hidden * inter / best


def step_flops(lm_cfg: Any, batch: list[Trajectory], layout: str, passes: float) -> float:
    """Model FLOPs of one RL step (see the module docstring); ``passes``: 3 for fwd+bwd, +1 per no-grad pass."""
    h, layers, vocab = lm_cfg.hidden_size, lm_cfg.num_hidden_layers, lm_cfg.vocab_size
    kv = lm_cfg.num_key_value_heads * (h // lm_cfg.num_attention_heads)
    per_token = layers * (2 * h * h + 2 * h * kv + 3 * h * lm_cfg.intermediate_size)  # decoder matmul params
    scored = sum(int(sum(int(m) for m in t.loss_mask[1:])) for t in batch)
    if layout == "shared_prefix":  # a group's prompt runs once
        prompts = {t.group_id: t.prompt_len for t in batch}
        inputs = sum(t.num_tokens for t in batch) - sum(prompts.values()) * (len(batch) // len(prompts) - 1)
    else:
        inputs = sum(t.num_tokens for t in batch)
    attn = sum(2 * layers * h * t.num_tokens**2 for t in batch)  # QK^T and AV, causal half, x2 FLOPs per MAC
    return 2 * passes * (per_token * inputs + h * vocab * scored + attn / 2)


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
    ap.add_argument("--shape", choices=["random", "demo"], default="random")
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--layout", default="packed")
    ap.add_argument("--kl-coef", type=float, default=0.0)
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--logits-chunk-tokens", type=int, default=None)
    ap.add_argument("--activation-checkpointing", default="auto")  # the trainer's default
    ap.add_argument("--no-minimal", action="store_true")
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--lora-r", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = str(resolve_model(args.model))
    batch = make_batch(args.batch) if args.shape == "random" else make_demo_batch(args.groups, args.group_size)
    tokens = sum(t.num_tokens for t in batch)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    lr = 1e-6
    extra: dict[str, Any] = {"activation_checkpointing": args.activation_checkpointing}
    if args.logits_chunk_tokens is not None:
        extra["logits_chunk_tokens"] = args.logits_chunk_tokens
    if args.lora:
        extra["lora"] = {"r": args.lora_r, "alpha": 2.0 * args.lora_r}
    cfg = TrainerConfig.model_validate(
        {
            "model": path,
            "dtype": "fp32",
            "optimizer": {"lr": lr, "grad_clip": 1.0},
            "loss": {"correction": "none", "advantage": "grpo", "kl_coef": args.kl_coef},
            "micro_batch_tokens": args.micro_batch_tokens,
            "layout": args.layout,
            **extra,
        }
    )
    lm_cfg = AutoConfig.from_pretrained(path)
    rate0 = matmul_flops(lm_cfg.hidden_size, lm_cfg.intermediate_size, args.threads)  # measured twice: the best
    trainer = Trainer(cfg)
    version = 0

    def trainer_step() -> None:
        nonlocal version
        trainer.rl_step(batch, current_version=version)
        version += 1

    trainer_step()  # warm-up (allocator, kernels, AdamW state)
    peak = peak_rss_gb()  # before the minimal loop's model exists: the trainer's own peak
    minimal = None if args.no_minimal else MinimalLoop(path, batch, lr)
    runs: dict[str, list[tuple[float, float]]] = {"trainer": []} if minimal is None else {"minimal": [], "trainer": []}
    if minimal is not None:
        minimal.step()
    for r in range(args.rounds):  # ABBA order: neither side always runs first
        order = ("minimal", "trainer") if r % 2 == 0 else ("trainer", "minimal")
        for k in order:
            if k in runs:
                runs[k].append(timed(minimal.step if k == "minimal" else trainer_step))  # type: ignore[union-attr]
    if minimal is None:
        peak = peak_rss_gb()  # the trainer alone in the process: its peak over every step
    best = {k: min(w for w, _ in v) for k, v in runs.items()}  # least disturbed by other processes
    cpu = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
    passes = (2 if args.lora else 3) + (1 if args.kl_coef > 0 else 0)  # LoRA: no weight gradients of the base
    rate = max(rate0, matmul_flops(lm_cfg.hidden_size, lm_cfg.intermediate_size, args.threads))
    # per core-second of CPU time (a shared machine stretches wall time, not the work): threads x fastest CPU time
    core_s = min(c for _, c in runs["trainer"]) / args.threads
    mfu = step_flops(lm_cfg, batch, args.layout, passes) / core_s / rate
    print(
        f"model={args.model} world_size=1 dtype=fp32 threads={args.threads} trajectories={len(batch)} "
        f"tokens/step={tokens} layout={args.layout} kl_coef={args.kl_coef} micro_batch_tokens={args.micro_batch_tokens} "
        f"lora_r={args.lora_r if args.lora else None} "
        f"logits_chunk_tokens={getattr(trainer.config, 'logits_chunk_tokens', None)} "
        f"activation_checkpointing={getattr(trainer, 'checkpointing', args.activation_checkpointing)} "
        f"matmul_gflops={rate / 1e9:.1f} cpu={cpu_model()}"
    )
    for k, v in runs.items():
        print(f"{k:<8} per-round wall s: {[round(w, 2) for w, _ in v]}  cpu s: {[round(c, 2) for _, c in v]}")
    print(f"{'loop':<22}{'best wall s':>12}{'tokens/s':>10}{'median cpu s':>14}{'tokens/cpu-s':>14}")
    for k, name in (("minimal", "minimal FSDP2 loop"), ("trainer", "agentrl Trainer")):
        if k in runs:
            print(f"{name:<22}{best[k]:>12.3f}{tokens / best[k]:>10.1f}{cpu[k]:>14.3f}{tokens / cpu[k]:>14.1f}")
    tr_tps = tokens / best["trainer"]
    min_tps = tokens / best["minimal"] if "minimal" in best else math.nan
    ratio = cpu["minimal"] / cpu["trainer"] if "minimal" in cpu else math.nan
    trainer.close()
    dist.destroy_process_group()
    print(
        f"trainer_vs_minimal_ratio={tr_tps / min_tps:.3f} trainer_tokens_per_s={tr_tps:.1f} "
        f"minimal_tokens_per_s={min_tps:.1f} cpu_time_ratio={ratio:.3f} trainer_step_s={best['trainer']:.2f} "
        f"trainer_peak_rss_gb={peak:.2f} trainer_mfu={mfu:.3f} trainer_cpu_s={cpu['trainer']:.2f} "
        f"lora={int(args.lora)} cpu={cpu_model()}"
    )


if __name__ == "__main__":
    main()
