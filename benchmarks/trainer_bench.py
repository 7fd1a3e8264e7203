"""Trainer throughput: agentrl's Trainer.rl_step vs a minimal hand-written FSDP2 loop, same model, same batch.

Both sides: FSDP2 (``fully_shard`` per decoder layer, then the root) over gloo at world size 1, fp32, AdamW,
gradient clipping at 1.0, the PPO clipped surrogate against the engine's behaviour logprobs (agentrl's
``correction: none``, one forward/backward per micro-batch) with token-mean aggregation. The minimal loop is the
floor that does the same work, written by hand the way one would write it well: the trajectories **packed** end
to end into rows of at most ``--micro-batch-tokens`` (position ids restarting per trajectory, no padding), the LM
head and log-softmax on the **scored positions only**, as the trainer does in its ``packed`` layout (before issue
24 the floor padded the batch and ran the head on every position, so the trainer looked faster than it is). The
batch is RL-shaped: variable-length multi-turn trajectories with a masked observation span.
After an untimed warm-up step of each, ``--rounds`` rounds (≥ 7 for a figure to quote) alternate between the two
(the order flips every round) so that load from other processes hits both alike; the headline is the median of
the per-round wall-time ratios minimal / trainer (> 1: the trainer is faster) and its range (a range containing 1
is parity); the same for process CPU time as a cross-check (the work done, which a shared machine does not
stretch). tokens/s use each side's median round.

``--shape demo`` builds the demo's RL step instead: ``--groups`` groups of ``--group-size`` responses sharing one
~86-token prompt, ~146 tokens a trajectory (6 x 8 = 48 trajectories, ~7,000 tokens, as ``agentrl demo``), and
``--layout``, ``--kl-coef``, ``--micro-batch-tokens``, ``--logits-chunk-tokens`` and ``--activation-checkpointing``
set the trainer as a recipe would (``--no-minimal`` times the trainer alone; the minimal loop has no KL term and
no shared prefix, so it is the floor of ``--layout packed --kl-coef 0`` only).

Memory: ``trainer_peak_rss_gb`` is the process's ``VmHWM`` after building the Trainer and running its two warm-up
steps (the second is the steady-state peak: AdamW's state then exists), before the minimal loop exists (so it is the trainer's peak: weights, gradients, AdamW state, reference
model, activations, logits, allocator); with ``--no-minimal`` it covers every step. ``trainer_mfu``: the model
FLOPs of a step (6 x decoder matmul parameters x input tokens + 6 x hidden x vocab x scored tokens + attention, 2/6
of that for no-grad passes; recomputation not counted) per second of the round with the least process CPU time
divided by the thread count (the machine is shared: other processes stretch wall time, not the work done), over
the fp32 matmul rate of this process measured in the same run with the same thread count, before and after the
rounds, by CPU time too (``[2048, hidden] x [hidden, intermediate]``, the shape of a decoder MLP).

``--lora`` trains LoRA adapters instead of the full model (``trainer.lora``: ``--lora-r``, alpha 2r, every linear
of the decoder; the reference is then the policy with its adapters off, no second model): compare its
``trainer_peak_rss_gb`` and ``trainer_step_s`` with the same command without it. Its ``trainer_mfu`` counts 2
passes, not 3, for a step's forward and backward (the frozen base gets no weight gradients: forward + input
gradients; the adapters' own FLOPs are left out).

``--no-lean`` gives the trainer the model's own MLPs and RMSNorms (``trainer.lean_activations: false``): compare its
``trainer_peak_rss_gb`` and ``trainer_cpu_s`` with the same command without it (the minimal loop has the model's own
in both).

``--live-memory`` measures what a step holds at its peak rather than the process's high-water mark: the bench
restarts itself with jemalloc preloaded and returning freed pages at once (``MALLOC_CONF=dirty_decay_ms:0,
muzzy_decay_ms:0``), so resident memory follows the live heap, and a thread reads ``VmRSS`` every 2 ms inside each
timed step: ``trainer_live_peak_gb`` (the highest, over the timed steps) and ``trainer_held_gb`` (the median after
a step: weights, gradients, AdamW state, the reference model, the allocator's retained metadata). ``VmHWM`` cannot
show a saving inside the backward pass (glibc keeps pages, and the first steps set the mark; lean activations:
5.952 vs 5.953 GB where the live peak fell by 272 MiB). Implies ``--no-minimal``; its CPU times pay for the
immediate page returns (not for A/B of speed: run without it).

``--vary-shapes`` trains each step (warm-ups included) on a new batch of the same kind (seed = the step's number),
as a run does: its micro-batches then have new widths, and the per-shape state a CPU keeps (oneDNN compiles a kernel
for each bf16 matmul shape and keeps up to 1,024) grows as in a run, where one batch repeated would flatter the
memory figure; implies ``--no-minimal``; ``trainer_mfu`` is then the best step's, and ``tokens`` a step's mean.
``--pad-to-multiple-of`` sets ``trainer.pad_to_multiple_of`` (auto: the trainer's choice).

``--dtype bf16`` runs both sides in mixed precision (the trainer's ``dtype: bf16``; the minimal loop with FSDP2's
``MixedPrecisionPolicy``: fp32 master weights, bf16 compute, fp32 gradient reduction) and measures the matmul rate in
bf16; ``--dtype auto`` takes what the trainer's ``auto`` takes on this CPU (bf16 where it multiplies faster:
agentrl.hardware). The default stays fp32 (the figures in docs/results.md before 2026-11-29 are fp32). In bf16 the
trainer computes short attention in fp32 where this CPU measured that faster (``trainer.attention_fp32_max_keys``,
agentrl.trainer.sdpa_precision) and the minimal loop calls Hugging Face's SDPA as is: the ratio then includes that
choice (``benchmarks/sdpa_precision_bench.py`` isolates it).

Usage: ``python benchmarks/trainer_bench.py [--model smollm2-135m-instruct|tiny] [--rounds 7] [--threads 1]
[--shape demo --layout shared_prefix --kl-coef 0.05] [--quick] [--lora [--lora-r 16]] [--dtype fp32|bf16|auto]`` (``--shape demo``: the
demo's step, with its recipe's 1,024-token micro-batches unless ``--micro-batch-tokens`` says otherwise).
Last line: ``trainer_vs_minimal_ratio=… trainer_vs_minimal_ratio_range=… rounds=…
trainer_vs_minimal_cpu_ratio=… minimal_tokens_per_s=… trainer_tokens_per_s=… trainer_step_s=…
trainer_peak_rss_gb=… trainer_mfu=… trainer_cpu_s=… lora=0|1 … cpu=… cores=… dtype=fp32|bf16 commit=… torch=… transformers=…``
(benchmarks/_common.py).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _common import (  # this folder's
    MIN_ROUNDS,
    Comparison,
    RssSampler,
    decoder_matmul_params,
    environment,
    interleaved,
    last_line,
    peak_rss_gb,
    reexec_with_live_memory,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from agentrl.hardware import resolve_dtype
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


def matmul_flops(hidden: int, inter: int, threads: int, reps: int = 30, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s per core of ``[2048, hidden] @ [hidden, inter]`` in ``dtype`` in this process: the best of ``reps`` by
    process CPU time / ``threads`` (another process time-slicing the core stretches wall time, not CPU time)."""
    a, b = torch.randn(2048, hidden, dtype=dtype), torch.randn(hidden, inter, dtype=dtype)
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
    per_token = decoder_matmul_params(lm_cfg)
    scored = sum(int(sum(int(m) for m in t.loss_mask[1:])) for t in batch)
    if layout == "shared_prefix":  # a group's prompt runs once
        prompts = {t.group_id: t.prompt_len for t in batch}
        inputs = sum(t.num_tokens for t in batch) - sum(prompts.values()) * (len(batch) // len(prompts) - 1)
    else:
        inputs = sum(t.num_tokens for t in batch)
    attn = sum(2 * layers * h * t.num_tokens**2 for t in batch)  # QK^T and AV, causal half, x2 FLOPs per MAC
    return 2 * passes * (per_token * inputs + h * vocab * scored + attn / 2)


class _Scored(nn.Module):
    """Decoder, then the LM head and log-softmax at the scored positions only (one module, so that FSDP2's root
    hooks gather the embeddings and the head around it)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, index: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = self.lm.get_decoder()(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
        logits = self.lm.get_output_embeddings()(hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)).float()
        return torch.log_softmax(logits, -1).gather(-1, targets[:, None])  # [n, 1]: squeezed by the caller (FSDP2
        # warns about a module returning a view)


class MinimalLoop:
    """The hand-written floor, doing the work the trainer must do and no more: trajectories packed end to end into
    rows of at most ``budget`` tokens (position ids restart per trajectory, no attention mask: transformers then
    masks block-diagonally, as for the trainer's ``packed`` layout; no padding), one forward/backward per row
    (gradient accumulation), the LM head and log-softmax at scored positions only, the PPO clipped surrogate with
    GRPO advantages, token mean over the batch. What the trainer does beyond it: metrics (entropy, clip fractions,
    staleness), the micro-batch planner, chunked logits, the checks."""

    def __init__(self, path: str, batch: list[Trajectory], lr: float, budget: int, bf16: bool = False) -> None:
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        self.model = _Scored(lm)
        rewards = torch.tensor([t.reward for t in batch])
        groups = [t.group_id for t in batch]
        adv = torch.zeros(len(batch))
        for g in set(groups):
            sel = torch.tensor([x == g for x in groups])
            adv[sel] = (rewards[sel] - rewards[sel].mean()) / (rewards[sel].std() + 1e-6)
        rows: list[list[int]] = [[]]
        for i, t in enumerate(batch):  # first fit in order
            if rows[-1] and sum(batch[j].num_tokens for j in rows[-1]) + t.num_tokens > budget:
                rows.append([])
            rows[-1].append(i)
        self.rows = []  # per row: ids [1, n], positions [1, n], scored index, targets, behaviour logprobs, advantages
        for row in rows:
            ids: list[int] = []
            pos: list[int] = []
            index: list[int] = []
            targets: list[int] = []
            behav: list[float] = []
            adv_row: list[float] = []
            for i in row:
                t, off = batch[i], len(ids)
                tok, mask, blp = (np.asarray(x).tolist() for x in (t.token_ids, t.loss_mask, t.behavior_logprobs))
                scored = [j for j in range(t.num_tokens - 1) if mask[j + 1]]  # position j predicts j + 1
                ids += tok
                pos += range(t.num_tokens)
                index += [off + j for j in scored]
                targets += [tok[j + 1] for j in scored]
                behav += [blp[j + 1] for j in scored]
                adv_row += [float(adv[i])] * len(scored)
            self.rows.append((torch.tensor(ids)[None], torch.tensor(pos)[None], torch.tensor(index),
                              torch.tensor(targets), torch.tensor(behav), torch.tensor(adv_row)))
        self.scored = sum(r[2].numel() for r in self.rows)
        self._check_packing(batch, rows[0])  # in fp32, before any bf16 policy: its round-off would hide nothing
        mesh = init_device_mesh("cpu", (1,))
        # bf16: the usual mixed precision (fp32 master weights, bf16 compute, fp32 gradient reduction), as the trainer's
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        for layer in lm.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(self.model, mesh=mesh, mp_policy=mp)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)

    @torch.no_grad()
    def _check_packing(self, batch: list[Trajectory], row: list[int]) -> None:
        """The packed row's logprobs equal each trajectory's run alone (else tokens attended across trajectories
        and the floor would do different work)."""
        ids, pos, index, targets = self.rows[0][:4]
        packed = self.model(ids, pos, index, targets).squeeze(-1)
        alone = []
        for i in row:
            t = batch[i]
            one = torch.tensor(np.asarray(t.token_ids).tolist())
            scored = torch.tensor([j for j, m in enumerate(np.asarray(t.loss_mask)[1:].tolist()) if m])
            alone.append(self.model(one[None], torch.arange(t.num_tokens)[None], scored, one[scored + 1]).squeeze(-1))
        if not torch.allclose(packed, torch.cat(alone), atol=1e-4):
            raise RuntimeError(f"packing changed the logprobs (max difference "
                               f"{(packed - torch.cat(alone)).abs().max():.2e}): the attention is not block-diagonal")

    def step(self) -> float:
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for ids, pos, index, targets, behav, adv in self.rows:
            logp = self.model(ids, pos, index, targets).squeeze(-1)
            ratio = torch.exp(logp - behav)
            loss = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.28)).sum() / self.scored
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return total


def timed(fn) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(wall seconds, process CPU seconds) of one call."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    ap.add_argument("--threads", type=int, default=1)  # 2 cores shared: 1 avoids OMP stalls
    ap.add_argument("--shape", choices=["random", "demo"], default="random")
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--layout", default="packed")
    ap.add_argument("--kl-coef", type=float, default=0.0)
    ap.add_argument("--micro-batch-tokens", type=int, default=None,
                    help="default: 1024 with --shape demo (the demo recipe's), else 16384")
    ap.add_argument("--logits-chunk-tokens", type=int, default=None)
    ap.add_argument("--activation-checkpointing", default="auto")  # the trainer's default
    ap.add_argument("--no-minimal", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="a check that the script runs: the tiny model, 4 trajectories, 2 rounds (not a figure)")
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--no-lean", action="store_true")  # trainer.lean_activations false: the model's own MLP and norms
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--dtype", choices=["fp32", "bf16", "auto"], default="fp32")
    ap.add_argument("--keep-gathered", choices=["auto", "true", "false"], default="auto")  # trainer.keep_gathered
    ap.add_argument("--pad-to-multiple-of", default="auto")  # trainer.pad_to_multiple_of
    ap.add_argument("--vary-shapes", action="store_true",
                    help="a new batch of the same kind every step, as in a run (implies --no-minimal)")
    ap.add_argument("--live-memory", action="store_true",
                    help="jemalloc returning freed pages at once, VmRSS sampled inside each step (implies --no-minimal)")
    args = ap.parse_args()
    if args.quick:
        args.model, args.batch, args.rounds = "tiny", 4, 2
    if args.live_memory:
        reexec_with_live_memory()  # returns in a process that allocates so (or exits saying why not)
        args.no_minimal = True  # the minimal loop's model in the same process would be in the figure
    if args.vary_shapes:
        args.no_minimal = True  # the minimal loop takes one batch
    if args.micro_batch_tokens is None:  # --shape demo times the demo's step: its recipe's micro-batches
        args.micro_batch_tokens = 1024 if args.shape == "demo" else 16384
    # auto: the trainer's own choice on this CPU (agentrl.hardware: bf16 where it multiplies faster)
    dtype = resolve_dtype(args.dtype, "cpu").dtype
    env = environment(dtype=dtype, packages=("torch", "transformers"))
    torch.set_num_threads(args.threads)
    path = str(resolve_model(args.model))

    def make(seed: int) -> list[Trajectory]:
        return (make_batch(args.batch, seed) if args.shape == "random"
                else make_demo_batch(args.groups, args.group_size, seed))

    batch = make(0)
    # --vary-shapes: step i trains on batch i (warm-ups included), else every step on batch 0
    batches = [make(i) if args.vary_shapes else batch for i in range(args.rounds + 2)]
    tokens = round(statistics.mean(sum(t.num_tokens for t in b) for b in batches[2:]))  # a timed step's, mean
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    lr = 1e-6
    extra: dict[str, Any] = {"activation_checkpointing": args.activation_checkpointing,
                             "lean_activations": not args.no_lean,
                             "keep_gathered": {"true": True, "false": False}.get(args.keep_gathered, "auto"),
                             "pad_to_multiple_of": args.pad_to_multiple_of}
    if args.logits_chunk_tokens is not None:
        extra["logits_chunk_tokens"] = args.logits_chunk_tokens
    if args.lora:
        extra["lora"] = {"r": args.lora_r, "alpha": 2.0 * args.lora_r}
    cfg = TrainerConfig.model_validate(
        {
            "model": path,
            "dtype": dtype,
            "optimizer": {"lr": lr, "grad_clip": 1.0},
            "loss": {"correction": "none", "advantage": "grpo", "kl_coef": args.kl_coef},
            "micro_batch_tokens": args.micro_batch_tokens,
            "layout": args.layout,
            **extra,
        }
    )
    lm_cfg = AutoConfig.from_pretrained(path)
    mm_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    rate0 = matmul_flops(lm_cfg.hidden_size, lm_cfg.intermediate_size, args.threads, dtype=mm_dtype)  # twice: the best
    trainer = Trainer(cfg)
    version = 0
    sampler = RssSampler() if args.live_memory else None
    held: list[int] = []  # resident bytes after each timed step (--live-memory)

    def trainer_step() -> None:
        nonlocal version
        trainer.rl_step(batches[version], current_version=version)
        version += 1

    def sampled_step() -> None:
        assert sampler is not None
        with sampler.phase("step"):
            trainer_step()
        held.append(sampler.rss())

    trainer_step()  # warm-up (allocator, kernels, AdamW state) ...
    trainer_step()  # ... twice: AdamW's state exists from the first step's end, so the second is the steady peak
    peak = peak_rss_gb()  # before the minimal loop's model exists: the trainer's own peak
    runs: dict[str, list[tuple[float, float]]]
    cmp: Comparison[tuple[float, float]] | None = None
    if args.no_minimal:
        runs = {"trainer": [timed(sampled_step if sampler else trainer_step) for _ in range(args.rounds)]}
        peak = peak_rss_gb()  # the trainer alone in the process: its peak over every step
    else:
        minimal = MinimalLoop(path, batch, lr, args.micro_batch_tokens, bf16=dtype == "bf16")
        minimal.step()  # its warm-up (the trainer's was above)
        # alternating rounds: load from other processes hits both alike; ratio = minimal wall / trainer wall
        cmp = interleaved(args.rounds, lambda: timed(minimal.step), lambda: timed(trainer_step),
                          rate=lambda r: 1 / r[0], warmup=False)
        runs = {"minimal": cmp.base, "trainer": cmp.ours}
    cpu = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
    wall = {k: statistics.median(w for w, _ in v) for k, v in runs.items()}
    passes = (2 if args.lora else 3) + (1 if args.kl_coef > 0 else 0)  # LoRA: no weight gradients of the base
    rate = max(rate0, matmul_flops(lm_cfg.hidden_size, lm_cfg.intermediate_size, args.threads, dtype=mm_dtype))
    # per core-second of CPU time (a shared machine stretches wall time, not the work): threads x fastest CPU time
    # each timed step's FLOPs per core-second; the best (the least disturbed step, as with one batch)
    mfu = max(step_flops(lm_cfg, b, args.layout, passes) / (c / args.threads) / rate
              for b, (_, c) in zip(batches[2:], runs["trainer"]))
    chunk = getattr(trainer.config, "logits_chunk_tokens", None)
    checkpointing = getattr(trainer, "checkpointing", args.activation_checkpointing)
    print(
        f"model={args.model} world_size=1 dtype={dtype} threads={args.threads} trajectories={len(batch)} "
        f"tokens/step={tokens} layout={args.layout} kl_coef={args.kl_coef} micro_batch_tokens={args.micro_batch_tokens} "
        f"lora_r={args.lora_r if args.lora else None} "
        f"logits_chunk_tokens={chunk} activation_checkpointing={checkpointing} matmul_gflops={rate / 1e9:.1f}"
    )
    if cmp is not None and (args.layout != "packed" or args.kl_coef > 0):
        print("note: the minimal loop is packed without a KL term: against this trainer configuration it does less "
              "work (compare with --layout packed --kl-coef 0)")
    for k, v in runs.items():
        print(f"{k:<8} per-round wall s: {[round(w, 2) for w, _ in v]}  cpu s: {[round(c, 2) for _, c in v]}")
    print(f"{'loop':<28}{'median wall s':>14}{'tokens/s':>10}{'median cpu s':>14}{'tokens/cpu-s':>14}")
    for k, name in (("minimal", "minimal FSDP2 loop (packed)"), ("trainer", "agentrl Trainer")):
        if k in runs:
            print(f"{name:<28}{wall[k]:>14.3f}{tokens / wall[k]:>10.1f}{cpu[k]:>14.3f}{tokens / cpu[k]:>14.1f}")
    trainer.close()
    dist.destroy_process_group()
    figures: dict[str, Any] = {}
    if sampler is not None:
        sampler.close()
        print(f"live memory (jemalloc, pages returned at once): peak inside a step {sampler.peaks['step'] / 1e9:.3f} GB, "
              f"after each step {[round(h / 1e9, 3) for h in held]} GB; CPU times include the page returns")
        figures.update({"trainer_live_peak_gb": sampler.peaks["step"] / 1e9,
                        "trainer_held_gb": statistics.median(held) / 1e9,
                        "malloc": "jemalloc_live"})  # reexec_with_live_memory checked it
    if cmp is not None:
        cpu_cmp = Comparison(cmp.base, cmp.ours, [m[1] / t[1] for m, t in zip(cmp.base, cmp.ours)])
        lo, hi = cmp.range
        print(f"trainer vs the packed minimal loop (per-round wall-time ratios): median {cmp.median:.3f}, range "
              f"{lo:.3f}-{hi:.3f} ({'parity within noise' if cmp.parity else 'outside the noise'}); CPU time: median "
              f"{cpu_cmp.median:.3f}" + ("" if args.rounds >= MIN_ROUNDS else
                                          f"; only {args.rounds} rounds: a check, not a figure to quote"))
        figures.update({**cmp.fields("trainer_vs_minimal_ratio"), "trainer_vs_minimal_cpu_ratio": cpu_cmp.median,
                        "trainer_vs_minimal_cpu_ratio_range": cpu_cmp.range,
                        "minimal_tokens_per_s": tokens / wall["minimal"]})
    figures.update({"trainer_tokens_per_s": tokens / wall["trainer"], "trainer_step_s": wall["trainer"],
                    "trainer_peak_rss_gb": peak, "trainer_mfu": mfu,
                    "trainer_cpu_s": cpu["trainer"], "lora": int(args.lora), "model": args.model, "tokens": tokens,
                    "layout": args.layout, "kl_coef": args.kl_coef, "threads": args.threads,
                    "lean_activations": int(not args.no_lean), "keep_gathered": int(trainer.keep_gathered),
                    "vary_shapes": int(args.vary_shapes), "pad_to_multiple_of": trainer.pad_to_multiple_of})
    print(last_line(figures, env))


if __name__ == "__main__":
    main()
