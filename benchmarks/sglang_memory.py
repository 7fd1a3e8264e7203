"""Memory of one SGLang CPU server, per process: launcher (HTTP + tokenizer manager; + the detokenizer thread by
default on CPU, ``engine.detokenizer``), scheduler, detokenizer (its own process in SGLang's layout only:
``--env AGENTRL_SGLANG_DETOKENIZER=process``).

Starts a real server the way agentrl does (:class:`agentrl.engine.SGLangServer`, the demo's settings unless told
otherwise), then three phases, each ended by a reading of every process of the server's process group:

- ``idle``: ready, nothing sent;
- ``--rounds`` times: ``load<r>``, ``--requests`` concurrent ``/generate`` calls of ~``--prompt-tokens`` prompt
  tokens and ``--max-new-tokens`` new ones (ignore_eos, with logprobs, as RL asks), then ``update<r>``, one weight
  update from disk (the model's own folder: the demo's ``weight_sync: disk`` path; ``--no-update`` skips it).

A reading per process: ``rss`` (VmRSS), ``hwm`` (VmHWM, the kernel's peak: what ``summary.json``'s ``memory``
block sums), ``anon`` (RssAnon: the process's own heap, not shared libraries), ``pss`` (smaps_rollup: shared pages
split between the processes that map them). A sampler thread also keeps each role's highest RSS seen (every
0.2 s). ``--env KEY=VALUE`` and ``--arg FLAG`` (repeatable) change the server; the last line carries the figures
(MiB) and the settings. Run it niced on a shared machine: memory, not time, is what it measures.

Usage: .venv/bin/python benchmarks/sglang_memory.py [--env MALLOC_ARENA_MAX=2] [--arg=--max-running-requests=64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import threading
from pathlib import Path

from _common import environment, key_values, last_line  # this folder's

from agentrl.engine import SamplingParams, SGLangClient, SGLangServer, SGLangServerConfig, Timeouts
from agentrl.models import resolve_model

MIB = 2**20
PATIENT = Timeouts(generate_s=3600.0, update_weights_s=3600.0)  # a niced server on a busy machine is slow
ROLES = {"sglang::scheduler": "scheduler", "sglang::detokenizer": "detokenizer"}


def group_pids(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[2]) == pgid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return out


def role(pid: int, pgid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return "gone"
    return ROLES.get(cmd, "launcher" if pid == pgid else "other")


def status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of ``pid`` in bytes (empty if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    keys = {"VmRSS": "rss", "VmHWM": "hwm", "RssAnon": "anon", "RssFile": "file"}
    return {name: int(fields[k].split()[0]) * 1024 for k, name in keys.items() if k in fields}


def pss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reading(pgid: int) -> dict[str, dict[str, int]]:
    """role → summed figures of its live processes."""
    out: dict[str, dict[str, int]] = {}
    for pid in group_pids(pgid):
        figures = {**status(pid), "pss": pss(pid)}
        if "rss" not in figures:
            continue
        into = out.setdefault(role(pid, pgid), {})
        for k, v in figures.items():
            into[k] = into.get(k, 0) + v
    return out


class PeakRss(threading.Thread):
    """The highest RSS of each role seen by a pass every ``interval_s``."""

    def __init__(self, pgid: int, interval_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pgid, self.interval_s, self.peaks = pgid, interval_s, {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval_s):
            for pid in group_pids(self.pgid):
                rss = status(pid).get("rss", 0)
                r = role(pid, self.pgid)
                self.peaks[r] = max(self.peaks.get(r, 0), rss)


async def load(url: str, prompts: list[list[int]], max_new: int) -> int:
    sampling = SamplingParams(max_new_tokens=max_new, temperature=1.0, ignore_eos=True, stop=("</code>",))
    async with SGLangClient(url, timeouts=PATIENT) as client:
        outs = await asyncio.gather(*(client.generate(p, sampling) for p in prompts))
    return sum(len(o.output_ids) for o in outs)


async def update(url: str, path: str) -> None:
    async with SGLangClient(url, timeouts=PATIENT) as client:
        await client.update_weights(path, 1)


def show(phase: str, figures: dict[str, dict[str, int]]) -> None:
    for r, f in sorted(figures.items()):
        print(f"{phase:8s} {r:12s} " + " ".join(f"{k}={v / MIB:7.0f}" for k, v in sorted(f.items())) + " MiB",
              flush=True)


async def main(args: argparse.Namespace) -> None:
    model = resolve_model(args.model)
    env = key_values(args.env, "--env")
    config = SGLangServerConfig(model_path=str(model), dtype=args.dtype, max_total_tokens=args.max_total_tokens,
                                context_length=args.context_length, extra_args=list(args.arg), env=env)
    footer = environment(dtype=args.dtype, packages=("sglang", "torch"))
    log = Path(tempfile.gettempdir()) / f"sglang_memory_{os.getpid()}.log"
    server = SGLangServer(config, log_path=log)
    print("command:", " ".join(server.command()), "env:", env, flush=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(args.prompt_tokens // 2, args.prompt_tokens * 3 // 2))]
               for _ in range(args.requests)]
    phases: dict[str, dict[str, dict[str, int]]] = {}
    server.start()
    try:
        assert server.pid is not None
        sampler = PeakRss(server.pid)
        sampler.start()
        phases["idle"] = reading(server.pid)
        show("idle", phases["idle"])
        tokens = 0
        for r in range(1, args.rounds + 1):
            tokens += await load(server.url, prompts, args.max_new_tokens)
            phases[f"load{r}"] = reading(server.pid)
            show(f"load{r}", phases[f"load{r}"])
            if not args.no_update:
                await update(server.url, str(model))
                phases[f"update{r}"] = reading(server.pid)
                show(f"update{r}", phases[f"update{r}"])
        sampler.done.set()
        sampler.join()
    finally:
        server.stop()
    last = phases[list(phases)[-1]]
    figures: dict[str, object] = {"label": args.label or "-", "tokens": tokens}
    for r, f in sorted(last.items()):
        figures.update({f"{r}_hwm": f["hwm"] / MIB, f"{r}_anon": f.get("anon", 0) / MIB, f"{r}_pss": f["pss"] / MIB,
                        f"{r}_peak_rss": sampler.peaks.get(r, 0) / MIB})
    figures["total_hwm"] = sum(f["hwm"] for f in last.values()) / MIB
    figures["total_pss"] = sum(f["pss"] for f in last.values()) / MIB
    if args.json:
        Path(args.json).write_text(json.dumps({"phases": phases, "peak_rss": sampler.peaks, "env": env,
                                               "args": list(args.arg)}, indent=1))
    print(last_line({**figures, "env": ",".join(args.env) or "-", "args": ",".join(args.arg) or "-"}, footer))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-total-tokens", type=int, default=16384)  # the demo's (SGLangServerConfig's default)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="rounds of load, then a weight update")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE in the server's environment")
    p.add_argument("--arg", action="append", default=[], help="an extra server flag (use --arg=--flag=value)")
    p.add_argument("--no-update", action="store_true", help="skip the weight update phase")
    p.add_argument("--label", default="")
    p.add_argument("--json", default="", help="write every reading to this file")
    asyncio.run(main(p.parse_args()))
