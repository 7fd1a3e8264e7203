"""Trainer memory over a run: does the trainer's resident memory stay near what it holds as step shapes change?

``trainer_bench.py`` repeats one batch, so its peak is one step's. A run's steps differ (how many turns each
episode took, how long each answer was), and with glibc's default mmap threshold (which rises to 32 MiB after the
first large free) the heap may fragment as the tensors' sizes change. ``trainer.mmap_threshold_kb``
(agentrl/heap.py) fixes the threshold; measured here, it saves ~0.2 GB (docs/results.md): most of the demo trainer's
growth (6.4 GB after SFT, 8.0 GB 30 RL steps later) was a leak, fixed since. This benchmark runs ``--steps`` RL
steps of the demo's shape (``--groups`` x ``--group-size``
trajectories of 1-3 turns, a new random shape each step, the same sequence for every configuration) in one
process per configuration: ``--thresholds`` (KiB, 0 is glibc's default; or ``never``, the default: no block is
mapped, freed memory is reused), the processes run side by side (one
thread each, so the two cores carry one each and load hits both alike) and each reports its ``VmHWM`` after the
first step and after the last, the tensors it holds after the last (``live_tensor_gb``: a leak grows it, an
allocator does not) and its median process CPU time a step.

The demo's trainer settings: ``shared_prefix`` layout, KL 0.05 (a reference model beside the policy),
1,024-token micro-batches, ``dtype`` auto (bf16 where the CPU multiplies it fast), SmolLM2-135M.

Usage: ``python benchmarks/trainer_memory.py [--steps 10] [--thresholds 1024 never] [--dtype fp32] [--quick]``. Last line:
``peak_rss_gb_<kib>=… first_step_rss_gb_<kib>=… growth_gb_<kib>=… live_tensor_gb_<kib>=… cpu_s_<kib>=… … peak_ratio=… cpu_ratio=…``
(each threshold's figures; the ratios: the last threshold's over the first's) and the environment
(benchmarks/_common.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from _common import environment, last_line, peak_rss_gb  # this folder's

from agentrl.heap import preload_env
from agentrl.types import FinishReason, Trajectory


def demo_step(seed: int, groups: int, group_size: int) -> list[Trajectory]:
    """One RL step of the demo's shape: each group's responses continue one prompt, 1-3 turns of model tokens with
    an interpreter observation (loss mask 0) between them."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(76, 96))]
        for k in range(group_size):
            ids, mask = list(prompt), [0] * len(prompt)
            turns = rng.randint(1, 3)
            for t in range(turns):
                n = rng.randint(20, 60) if t < turns - 1 else rng.randint(8, 40)
                ids += [rng.randrange(100, 40000) for _ in range(n)]
                mask += [1] * n
                if t < turns - 1:
                    o = rng.randint(8, 24)
                    ids += [rng.randrange(100, 40000) for _ in range(o)]
                    mask += [0] * o
            out.append(Trajectory(
                trajectory_id=f"{seed}-{g}-{k}", prompt_id=str(g), group_id=f"{seed}-{g}", token_ids=ids,
                prompt_len=len(prompt), loss_mask=mask,
                behavior_logprobs=[-rng.uniform(0.5, 4) if m else 0.0 for m in mask],
                weight_versions=[0 if m else -1 for m in mask], reward=float(rng.random() < 0.5),
                finish_reason=FinishReason.STOP))
    return out


def live_tensor_gb() -> float:
    """Bytes of the distinct tensor storages Python can reach (gc-tracked tensors): what the process holds, to
    tell a leak (this grows with RSS) from the allocator (RSS grows, this does not)."""
    import gc

    import torch

    gc.collect()
    seen: dict[int, int] = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and not o.is_meta and o.device.type == "cpu":
            local = o.to_local() if hasattr(o, "to_local") else o
            st = local.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values()) / 1e9


def worker(args: argparse.Namespace) -> None:
    """One configuration in this process: prints one JSON line."""
    import torch
    import torch.distributed as dist

    from agentrl.models import resolve_model
    from agentrl.trainer import Trainer, TrainerConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = TrainerConfig.model_validate({
        "model": str(resolve_model(args.model)), "dtype": args.dtype, "layout": "shared_prefix",
        "micro_batch_tokens": 1024, **_heap_keys(args.worker),
        "optimizer": {"lr": 1e-6, "grad_clip": 1.0},
        "loss": {"advantage": "dr_grpo", "kl_coef": 0.05, "kl_estimator": "k3", "correction": "decoupled"}})
    hwm, cpu, live = [], [], []
    with Trainer(cfg) as tr:
        for step in range(args.steps):
            batch = demo_step(step, args.groups, args.group_size)
            c0 = time.process_time()
            tr.rl_step(batch, current_version=step)
            cpu.append(time.process_time() - c0)
            hwm.append(peak_rss_gb())
            live.append(live_tensor_gb())
        dtype = tr.precision.dtype
    dist.destroy_process_group()
    print(json.dumps({"hwm": hwm, "cpu": cpu, "live": live, "dtype": dtype,
                      "maxrss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}))


def _heap_keys(setting: int | str) -> dict[str, Any]:
    """The trainer keys of one ``--thresholds`` setting: a glibc threshold, or jemalloc (threshold left at never)."""
    if setting == "jemalloc":
        return {"malloc": "jemalloc", "mmap_threshold_kb": "never"}
    return {"malloc": "glibc", "mmap_threshold_kb": setting}


def _setting(text: str) -> int | str:
    return text if text in ("never", "jemalloc") else int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--thresholds", type=_setting, nargs="+", default=[1024, "never"],
                    help="trainer.mmap_threshold_kb values: KiB (0: glibc's default) or never; or jemalloc "
                         "(trainer.malloc: jemalloc, preloaded into that worker as the launcher does)")
    ap.add_argument("--quick", action="store_true", help="the tiny model, 3 steps of 2 x 2: checks the script runs")
    ap.add_argument("--worker", type=_setting, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.model, args.steps, args.groups, args.group_size = "tiny", 3, 2, 2
    if args.worker is not None:
        worker(args)
        return
    env = environment(dtype=args.dtype, packages=("torch", "transformers"))
    base = [sys.executable, __file__, "--model", args.model, "--steps", str(args.steps), "--groups",
            str(args.groups), "--group-size", str(args.group_size), "--dtype", args.dtype]
    procs = {kib: subprocess.Popen([*base, "--worker", str(kib)], stdout=subprocess.PIPE, text=True,
                                   env={**os.environ, **preload_env(_heap_keys(kib)["malloc"])})
             for kib in args.thresholds}
    results: dict[int | str, dict[str, Any]] = {}
    for kib, p in procs.items():
        out, _ = p.communicate(timeout=7200)
        if p.returncode != 0:
            raise SystemExit(f"the worker with mmap_threshold_kb {kib} failed (exit {p.returncode})")
        results[kib] = json.loads(out.strip().splitlines()[-1])
    figures: dict[str, Any] = {}
    for kib, r in results.items():
        print(f"mmap_threshold_kb {kib!s:>6}: VmHWM after each step GB {[round(x, 2) for x in r['hwm']]}; "
              f"live tensors GB {[round(x, 2) for x in r['live']]}; CPU s {[round(x, 1) for x in r['cpu']]} "
              f"({r['dtype']})")
        figures.update({f"peak_rss_gb_{kib}": r["hwm"][-1], f"first_step_rss_gb_{kib}": r["hwm"][0],
                        f"growth_gb_{kib}": r["hwm"][-1] - r["hwm"][0], f"live_tensor_gb_{kib}": r["live"][-1],
                        f"cpu_s_{kib}": statistics.median(r["cpu"][1:] or r["cpu"])})
    first, last = args.thresholds[0], args.thresholds[-1]
    if first != last:
        figures["peak_ratio"] = figures[f"peak_rss_gb_{last}"] / figures[f"peak_rss_gb_{first}"]
        figures["cpu_ratio"] = figures[f"cpu_s_{last}"] / figures[f"cpu_s_{first}"]
    figures.update({"steps": args.steps, "model": args.model,
                    "trainer_dtype": results[first]["dtype"]})
    print(last_line(figures, env))


if __name__ == "__main__":
    main()
