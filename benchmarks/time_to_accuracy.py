"""Time to accuracy, the demo's headline: how long `agentrl demo` takes until the policy it trains scores 0.9 on
the held-out wordings (greedy; the demo evaluates them after SFT, at every 5th weight version during RL and after
RL: ``data.heldout_every``, agentrl/launcher/heldout_curve.py).

It runs ``agentrl demo`` as the user would (its own process, every override passed through: ``--set key=value``
or trailing ``key=value``), in a run directory under a temporary directory (removed afterwards: checkpoints are
1.7 GB each) or ``--run-dir`` (kept), then reads its ``summary.json``. ``--quick`` checks that the script runs:
``agentrl demo --smoke`` (the tiny random model, 2 RL steps) with 4 held-out problems evaluated at every version;
the tiny model never answers right, so its times are ``none``. ``--lora`` runs ``agentrl demo --lora`` (the demo
training LoRA adapters); the line then says ``lora=r16`` (``none``: full fine-tuning).

A single run, not a comparison: there is no floor to alternate with (the figure is the run's own), and one run's
time varies with the seed (docs/results.md#the-demo). The times are the start of the first evaluation from SFT on
that reached 0.9, since the run started (``time_to_heldout_0.9_s``, from the controller's start: SFT included,
Python's and the servers' start-up not) and since RL started (``_rl_s``); ``none`` when no evaluation did.
Last line: ``time_to_heldout_0.9_s=… time_to_heldout_0.9_rl_s=… heldout_sft=… heldout_after=… wall_s=…
run_wall_s=… steps=… heldout_every=… heldout_evals=… cpu=… cores=… dtype=… commit=… …`` (benchmarks/_common.py).

``--memory-limit-gb X`` runs the demo, every process it starts included (Ray's, SGLang's, the sandboxes': all its
descendants), in a memory cgroup of X GiB with no swap beyond it (cgroup v1, the local sandbox's own cgroup code,
below this process's cgroup): "the demo fits in X GB" shown by the kernel rather than by adding up RSS. The line then
also has ``memory_limit_gb``, ``oom_kills`` (processes the kernel killed at the limit; agentrl restarts a killed
trainer or SGLang server, so a run can finish with kills: its figures then do not count), ``cgroup_peak_gb``
(the kernel's peak of the cgroup's charge, page cache included, so it reaches the limit whenever files were read)
and ``cgroup_anon_peak_gb`` (the largest ``total_rss + total_shmem`` of its ``memory.stat``, sampled every second:
the memory no reclaim can take back).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import environment, last_line  # this folder's

QUICK = ["data.num_heldout=4", "data.heldout_every=1"]  # the smoke recipe evaluates nothing held out by itself


def command(run_dir: Path, overrides: list[str], *, quick: bool, lora: bool = False) -> list[str]:
    """``agentrl demo`` (``--lora``: its LoRA recipe) in ``run_dir`` (its ``runs_dir`` and ``name``) with
    ``overrides`` last (they win)."""
    return [sys.executable, "-m", "agentrl.cli", "demo", *(["--smoke"] if quick else []),
            *(["--lora"] if lora else []),
            f"runs_dir={run_dir.parent}", f"name={run_dir.name}", "monitor.live=false",
            *(QUICK if quick else []), *overrides]


def figures(summary: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """The last line's figures from a run's ``summary.json``; a time never reached is ``none``."""

    def value(key: str) -> Any:
        got = summary.get(key)
        return "none" if got is None else got

    curve = summary.get("heldout_curve") or []
    memory = summary.get("memory") or {}
    return {"time_to_heldout_0.9_s": value("time_to_heldout_0.9_s"),
            "time_to_heldout_0.9_rl_s": value("time_to_heldout_0.9_rl_s"),
            "heldout_sft": value("heldout_accuracy_sft"), "heldout_after": value("heldout_accuracy_after"),
            "wall_s": wall_s, "run_wall_s": value("wall_time_s"), "steps": summary.get("steps", 0),
            "heldout_evals": len(curve), "heldout_evals_failed": summary.get("heldout_evals_failed", 0),
            # summary.json's memory block: Σ RSS of the run's processes (shared libraries counted per process) and
            # Σ RssAnon (each page once), peaks over time
            "peak_rss_gb": memory.get("peak_concurrent_gb", "none"),
            "peak_anon_gb": memory.get("peak_concurrent_anon_gb", "none")}


class MemoryLimit:
    """A memory cgroup for the demo's process tree (see the module's docstring); a context manager."""

    def __init__(self, limit_gb: float, *, interval_s: float = 1.0) -> None:
        from agentrl.sandbox._cgroup import CgroupTree

        tree = CgroupTree.detect()
        if tree is None or "memory" not in tree.parents:
            raise SystemExit("--memory-limit-gb needs a writable cgroup v1 memory controller (/sys/fs/cgroup/memory, "
                             "root or a delegated cgroup); none here")
        self.limit_gb = limit_gb
        self.cgroup = CgroupTree({"memory": tree.parents["memory"]}).create()
        self.dir = self.cgroup.dirs["memory"]
        self.cgroup.set_limits(memory_mb=int(limit_gb * 1024), pids=0, cpus=0.0)  # pids, cpu: not in this cgroup
        self.anon_peak = 0
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="cgroup-sampler", daemon=True)

    def enter(self) -> None:
        """For ``preexec_fn``: the child joins the cgroup before it execs, so everything it starts is inside."""
        (self.dir / "cgroup.procs").write_text(str(os.getpid()))

    def anon(self) -> int:
        stat = dict(line.split() for line in (self.dir / "memory.stat").read_text().splitlines())
        return int(stat["total_rss"]) + int(stat["total_shmem"])

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.anon_peak = max(self.anon_peak, self.anon())

    def __enter__(self) -> MemoryLimit:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.anon_peak = max(self.anon_peak, self.anon())
        self.result = self.figures()
        asyncio.run(self.cgroup.remove(timeout_s=30.0))  # kills what the demo left behind

    def figures(self) -> dict[str, Any]:
        gib = 2**30
        return {"memory_limit_gb": self.limit_gb, "oom_kills": self.cgroup.oom_kills(),
                "cgroup_peak_gb": int((self.dir / "memory.max_usage_in_bytes").read_text()) / gib,
                "cgroup_anon_peak_gb": self.anon_peak / gib}


def run_settings(run_dir: Path) -> dict[str, Any]:
    """What the run resolved (``config.yaml`` records it): the precisions, ``data.heldout_every`` and LoRA's rank
    (``lora=r16``; ``none``: full fine-tuning)."""
    from agentrl.launcher.config import load_config

    try:
        cfg = load_config(run_dir / "config.yaml")
    except Exception as exc:  # the footer says so rather than failing after a 45-minute run
        return {"heldout_every": "unknown", "lora": "unknown", "dtype": f"unknown({type(exc).__name__})"}
    lora = cfg.trainer.lora
    return {"heldout_every": cfg.data.heldout_every, "lora": "none" if lora is None else f"r{lora.r}",
            "dtype": f"engine:{cfg.engine.server.dtype},trainer:{cfg.trainer.dtype}"}


def measure(run_dir: Path, overrides: list[str], *, quick: bool, timeout_s: float,
            memory_limit_gb: float | None = None, lora: bool = False) -> tuple[dict[str, Any], str]:
    """Run the demo (its output goes to stderr, so stdout ends with the figures); its figures and precisions."""
    cmd = command(run_dir, overrides, quick=quick, lora=lora)
    print("running:", " ".join(cmd), file=sys.stderr, flush=True)
    limit = MemoryLimit(memory_limit_gb) if memory_limit_gb is not None else None
    t0 = time.monotonic()
    if limit is None:
        proc = subprocess.run(cmd, stdout=sys.stderr, timeout=timeout_s)
    else:
        with limit:
            proc = subprocess.run(cmd, stdout=sys.stderr, timeout=timeout_s, preexec_fn=limit.enter)
    wall_s = time.monotonic() - t0
    cgroup = limit.result if limit is not None else {}
    if proc.returncode != 0:
        raise SystemExit(f"agentrl demo failed (exit {proc.returncode}); its output is above, its logs in "
                         f"{run_dir / 'logs'}" + (f"; memory cgroup: {cgroup}" if cgroup else ""))
    from agentrl.launcher.report import version_span

    summary = json.loads((run_dir / "summary.json").read_text())
    for p in summary.get("heldout_curve") or []:
        print(f"{p['label']:>6} v{version_span(p)}: accuracy {p['accuracy']:.3f}, t_rl_s {p.get('t_rl_s')}, "
              f"t_run_s {p.get('t_run_s')}", flush=True)
    settings = run_settings(run_dir)
    return ({**figures(summary, wall_s), "heldout_every": settings["heldout_every"], "lora": settings["lora"],
             **cgroup}, settings["dtype"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="key=value overrides for agentrl demo, e.g. seed=1")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for agentrl demo (repeatable); the same as a trailing key=value")
    ap.add_argument("--run-dir", type=Path, help="the run directory (kept; default: one in a temporary directory, "
                                                 "removed afterwards); it must not hold a run")
    ap.add_argument("--quick", action="store_true",
                    help="agentrl demo --smoke with 4 held-out problems at every version: a check that this runs "
                         "(a few minutes), not a figure")
    ap.add_argument("--lora", action="store_true",
                    help="agentrl demo --lora: the demo training LoRA adapters (agentrl refuses it with --quick's --smoke)")
    ap.add_argument("--memory-limit-gb", type=float, metavar="X",
                    help="run the demo and all it starts in a memory cgroup of X GiB (cgroup v1; see above)")
    ap.add_argument("--timeout-s", type=float, default=3 * 3600.0, help="the demo's deadline (default 3 h)")
    args = ap.parse_args()
    overrides = [*args.sets, *args.overrides]
    bad = [o for o in overrides if "=" not in o]
    if bad:
        ap.error(f"overrides are key=value, got {bad}")
    env = environment(packages=("sglang", "torch", "transformers", "ray"))
    if args.run_dir is not None:
        got, dtype = measure(args.run_dir.resolve(), overrides, quick=args.quick, timeout_s=args.timeout_s,
                            memory_limit_gb=args.memory_limit_gb, lora=args.lora)
    else:
        with tempfile.TemporaryDirectory(prefix="time_to_accuracy-") as tmp:
            got, dtype = measure(Path(tmp) / "tta", overrides, quick=args.quick, timeout_s=args.timeout_s,
                                 memory_limit_gb=args.memory_limit_gb, lora=args.lora)
    print(last_line({**got, "quick": int(args.quick)}, {**env, "dtype": dtype}))


if __name__ == "__main__":
    main()
