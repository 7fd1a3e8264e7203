"""Async vs synchronous RL, same steps, same work: wall-clock of the RL phase.

sync  = η 0: rollout for step k waits for version k-1, the trainer waits for the rollout (strictly alternating);
async = η 1: rollout of step k+1 overlaps training of step k.
Rollout (with its SGLang server) is pinned to core 0 and the trainer to core 1, so each side has its own
resources as on a cluster. Model: SmolLM2-135M-Instruct without SFT (timing only). As one sizes a cluster so that
neither side idles, the precisions are chosen so that a rollout step and a trainer step take similar time here
(SGLang bf16, trainer fp32 by default: the speedup is bounded by (R + T) / max(R, T)); the table prints both.
Both modes checkpoint every 5 steps as the demo recipe does (a checkpoint every step would add ~3.7 s to each
trainer step here). Async runs one step's worth of groups at a time (``--max-running-groups 4``): η = 1 still lets
the rollout run a step ahead, and the first batch, which nothing can overlap, is ready as soon as in sync mode
(with 8 groups at once it came ~10 s later: two steps' episodes share the engine). Sync mode cannot run more
than one step's groups at a time anyway. Per-step trainer times (train, wait) are printed for both modes.

``--runs`` pairs (≥ 3 for a figure to quote) alternate the order (sync, async; then async, sync; …) so that what
a first run pays (cold page cache, compiled kernels) and load that drifts favour neither mode; there is no extra
warm-up run (each run starts its own servers and trainer: that start-up is outside ``rl_wall_s``). The headline
is the median of the per-pair ratios of rollout tokens per second of RL wall time, async / sync (both modes do
the same steps, so this is also the wall-clock speedup when both generate the same number of tokens), with its
range. Sync with the split placement leaves the rollout's core idle while the trainer works and vice versa, by
construction; ``--baseline colocated`` runs the fair floor instead: sync (η 0) with ``resources.placement:
colocated``, both sides on both cores taking turns, each phase with two threads (``agentrl.launcher.colocation``).
Last line: ``baseline=sync|colocated async_speedup=… async_speedup_range=… rounds=… sync_s=… async_s=… tokens_per_s=…
sync_tokens_per_s=… cpu=… cores=… dtype=… commit=… sglang=… torch=…`` (target ≥ 1.6; benchmarks/_common.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from _common import environment, interleaved, last_line  # this folder's

from agentrl.launcher.config import load_config
from agentrl.launcher.driver import run_training

MODES = {"sync": (0, "split"), "async": (1, "split"), "colocated": (0, "colocated")}  # name: (η, placement)


def config(runs: str, name: str, eta: int, steps: int, model: str, engine_dtype: str, trainer_dtype: str,
           update_mode: str, pause_mode: str, checkpoint_every: int, max_running_groups: int,
           placement: str = "split") -> dict:
    return {
        "name": name, "runs_dir": runs, "model": model, "steps": steps, "seed": 0,
        "checkpoint_every": checkpoint_every,
        "engine": {"dtype": engine_dtype},
        "sft": {"enabled": False},
        "data": {"train": "rl", "num_heldout": 0},
        "rollout": {"n_samples": 4, "groups_per_step": 4, "max_staleness": eta,
                    "max_running_groups": max_running_groups,
                    "max_new_tokens": 64, "max_turns": 2, "max_response_tokens": 128, "max_context_tokens": 512,
                    "temperature": 1.0, "update_mode": update_mode, "pause_mode": pause_mode},
        "env": {"name": "retool", "options": {"format_weight": 0.1}},
        "trainer": {"optimizer": {"lr": 1e-6}, "micro_batch_tokens": 1024, "dtype": trainer_dtype},
        "resources": {"rollout_cores": [0], "trainer_cores": [1], "placement": placement},  # colocated: both on [0, 1]
        "monitor": {"live": False, "prometheus_port": None, "tensorboard": False},
        "log_rollouts": "none",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--engine-dtype", default="bfloat16")
    ap.add_argument("--trainer-dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--checkpoint-every", type=int, default=5,
                    help="as the demo recipe: a 135M checkpoint with Adam state is 1.7 GB, ~3.7 s of the trainer's "
                         "step here; the last step is always checkpointed")
    ap.add_argument("--max-running-groups", type=int, default=4,
                    help="groups generating at once (4 = one step's worth: with η = 1 the rollout still runs a "
                         "step ahead, one step at a time, so the first batch is ready as soon as in sync mode)")
    ap.add_argument("--update-mode", default="interrupt", choices=["interrupt", "drain", "abort_restart"])
    ap.add_argument("--pause-mode", default="retract", choices=["retract", "in_place", "abort"],
                    help="how 'interrupt' pauses SGLang: retract recomputes the KV cache of in-flight requests on "
                         "the new weights, in_place keeps it (PipelineRL-style), abort resumes them client-side")
    ap.add_argument("--runs", type=int, default=3, help="alternating pairs of runs (≥ 3 for a figure to quote)")
    ap.add_argument("--baseline", default="sync", choices=["sync", "colocated"],
                    help="what async is compared with: sync on the split placement, or sync colocated (each phase "
                         "on both cores)")
    ap.add_argument("--quick", action="store_true", help="a check that the script runs: 2 steps, 1 pair (not a figure)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.runs = 2, 1
    env = environment(dtype=f"engine:{args.engine_dtype},trainer:{args.trainer_dtype}",
                      packages=("sglang", "torch", "transformers", "ray"))
    with tempfile.TemporaryDirectory() as runs:
        count = dict.fromkeys(MODES, 0)

        def run(mode: str) -> dict[str, Any]:
            eta, placement = MODES[mode]
            name = f"{mode}-{count[mode]}"
            count[mode] += 1
            cfg = load_config(None, base=config(runs, name, eta, args.steps, args.model, args.engine_dtype,
                                                args.trainer_dtype, args.update_mode, args.pause_mode,
                                                args.checkpoint_every, args.max_running_groups, placement))
            summary = asyncio.run(run_training(cfg))
            rows = [json.loads(x) for x in (Path(runs) / name / "metrics.jsonl").read_text().splitlines()]
            shutil.rmtree(Path(runs) / name)  # its checkpoints (1.7 GB each): six runs would fill a small disk
            train_s = sum(r["time_s"] - r["wait_s"] for r in rows) / len(rows)  # a trainer step without waiting
            print(f"{name} per step (train s, wait s): "
                  f"{[(round(r['time_s'] - r['wait_s'], 1), round(r['wait_s'], 1)) for r in rows]}", flush=True)
            print(f"{name:11s} η={eta}  rl_wall_s={summary['rl_wall_s']:8.1f}  steps={summary['steps']}  "
                  f"train_step_s={train_s:5.1f}  trainer_wait_s={sum(r['wait_s'] for r in rows) / len(rows):5.1f}  "
                  f"staleness_max={summary['staleness_max']}  tokens={summary['rollout_model_tokens']}  "
                  f"reload_s={summary['reload_s_mean'] or 0:.2f}  episodes_restarted={summary['episodes_restarted']}",
                  flush=True)
            return summary

        cmp = interleaved(args.runs, lambda: run(args.baseline), lambda: run("async"),
                          rate=lambda x: x["rollout_model_tokens"] / x["rl_wall_s"], warmup=False)
    sync_s = statistics.median(x["rl_wall_s"] for x in cmp.base)
    async_s = statistics.median(x["rl_wall_s"] for x in cmp.ours)
    tps = {k: statistics.median(x["rollout_model_tokens"] / x["rl_wall_s"] for x in side)
           for k, side in (("sync", cmp.base), ("async", cmp.ours))}
    print(json.dumps({"sync": [x["rl_wall_s"] for x in cmp.base], "async": [x["rl_wall_s"] for x in cmp.ours],
                      "staleness_max": [x["staleness_max"] for x in cmp.ours]}))
    print(last_line({"baseline": args.baseline, **cmp.fields("async_speedup"), "sync_s": sync_s, "async_s": async_s,
                     "wall_speedup": sync_s / async_s, "tokens_per_s": tps["async"], "sync_tokens_per_s": tps["sync"],
                     "steps": args.steps, "model": args.model}, env))


if __name__ == "__main__":
    main()
