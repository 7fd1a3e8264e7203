"""bf16 attention computed in fp32 where this CPU measured it faster (agentrl.trainer.sdpa_precision): the demo's RL
step with the measured choice against the same step with every attention call in bf16.

One process, one Trainer (bf16, the demo's recipe: ``shared_prefix`` layout, KL 0.05 with its reference pass,
1,024-token micro-batches, one thread), the demo's step shape (``trainer_bench.make_demo_batch``: 6 groups of 8
responses to one ~86-token prompt each). The two sides differ only in the limit the trainer's attention uses:
the limit the trainer measured at its start ("choice") or 0 (every call in bf16, as before). After an untimed
warm-up step, ``--rounds`` rounds alternate the two (order flipped every round); the headline is
the median of per-round ratios bf16 / choice of the step's **process CPU time** (the work done: a shared machine
stretches wall time, not CPU time) and its range (a range containing 1 is parity).

``--layout packed`` times the packed layout instead (Hugging Face's SDPA with a block-diagonal mask, through the
same choice). ``--quick``: the tiny model, 2 rounds, a check that the script runs.

Last line: ``bf16_vs_choice_cpu_ratio=… bf16_vs_choice_cpu_ratio_range=… rounds=… bf16_step_cpu_s=… choice_step_cpu_s=…
fp32_attention_up_to_keys=… layout=… model=… cpu=… cores=… dtype=bf16 commit=… torch=… transformers=…``
(benchmarks/_common.py).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
import torch.distributed as dist
from _common import MIN_ROUNDS, environment, interleaved, last_line  # this folder's
from trainer_bench import make_demo_batch  # this folder's

from agentrl.models import resolve_model
from agentrl.trainer import Trainer, TrainerConfig, sdpa_precision


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--layout", default="shared_prefix", choices=["shared_prefix", "packed", "padded"])
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="the tiny model, 2 rounds: a check that the script runs")
    args = ap.parse_args()
    if args.quick:
        args.model, args.rounds = "tiny", 2
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    env = environment(dtype="bf16", packages=("torch", "transformers"))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = TrainerConfig.model_validate({
        "model": str(resolve_model(args.model)), "dtype": "bf16", "optimizer": {"lr": 1e-6, "grad_clip": 1.0},
        "loss": {"advantage": "dr_grpo", "kl_coef": 0.05, "kl_estimator": "k3"}, "micro_batch_tokens": 1024,
        "layout": args.layout})
    batch = make_demo_batch(6, 8)
    trainer = Trainer(cfg)
    version = 0

    def step() -> float:
        nonlocal version
        t = time.process_time()
        trainer.rl_step(batch, current_version=version)
        version += 1
        return time.process_time() - t

    measured = trainer.attention_fp32_max_keys  # measured at the trainer's start (attention_fp32_max_keys: auto)
    step()  # warm-up

    def side(keys: int) -> float:
        sdpa_precision.set_limit(keys)
        return step()

    cmp = interleaved(args.rounds, lambda: side(0), lambda: side(measured), rate=lambda s: 1 / s, warmup=False)
    trainer.close()
    dist.destroy_process_group()
    print(f"per-round step CPU s, bf16: {[round(s, 2) for s in cmp.base]}  choice: {[round(s, 2) for s in cmp.ours]}")
    print(last_line({**cmp.fields("bf16_vs_choice_cpu_ratio"), "bf16_step_cpu_s": statistics.median(cmp.base),
                     "choice_step_cpu_s": statistics.median(cmp.ours),
                     "fp32_attention_up_to_keys": measured, "layout": args.layout,
                     "model": args.model, "threads": args.threads}, env))


if __name__ == "__main__":
    main()
