"""SGLang CPU decode while it borrows the waiting trainer's core vs on its own core (``resources.engine_borrows_idle_cores``).

One real SGLang server with agentrl's CPU fast paths, started as a split run starts it: pinned to the first core
(``rollout_cores: [0]``), ``OMP_NUM_THREADS=1``, and the borrowing variables naming the second core and a flag file.
Each round sends the same ``--requests`` prompts (``--concurrency`` at a time, ``--max-new-tokens`` each, ignore_eos)
once with the flag down (the trainer computing: the server on its own core) and once with it up (the trainer
waiting: this process's pid in the flag), alternating which goes first. The client runs on the server's core, as
the rollout actor does in a run, so the second core holds only what the server borrows.

Last line: ``borrow_vs_own=… tokens_per_s=… own_tokens_per_s=…`` (median of per-round ratios, median tokens/s).
Usage: .venv/bin/python benchmarks/engine_borrow_bench.py [--model smollm2-135m-instruct] [--dtype auto]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from _common import MIN_ROUNDS, ainterleaved, environment, last_line  # this folder's
from sglang_decode_bench import add_load_arguments, quick_load, random_prompts, round_tps  # this folder's

from agentrl.engine import SGLangServer, SGLangServerConfig
from agentrl.hardware import engine_dtype
from agentrl.launcher.cores import pin_to_cores
from agentrl.models import resolve_model


async def main(args: argparse.Namespace) -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("engine_borrow_bench needs two cores: one for the server, one to lend it")
    model = resolve_model(args.model)
    dtype = engine_dtype(args.dtype, "cpu")
    prompts = random_prompts(args)
    env = environment(dtype=dtype, packages=("sglang", "torch"))
    own, lend = cores[:1], cores[1:2]
    flag = Path(tempfile.mkdtemp(prefix="engine_borrow_bench_")) / "trainer-waiting"
    log = Path(tempfile.gettempdir()) / "engine_borrow_bench_sglang.log"
    server = SGLangServer(SGLangServerConfig(
        model_path=str(model), dtype=dtype, max_total_tokens=args.max_total_tokens,
        env={"OMP_NUM_THREADS": "1", "AGENTRL_BORROW_FLAG": str(flag), "AGENTRL_BORROW_CORES": str(lend[0])}),
        log_path=log)
    pin_to_cores(own)  # the server inherits it; the client stays there too (the rollout actor's core)
    try:
        await asyncio.to_thread(server.start)

        async def run(waiting: bool) -> float:
            if waiting:
                flag.write_text(str(os.getpid()))
                past = time.time() - 5  # raised long ago: past the scheduler's settling time
                os.utime(flag, (past, past))
            else:
                flag.unlink(missing_ok=True)
                await asyncio.sleep(0.3)  # past the scheduler's check interval
            tps = await round_tps(server.url, prompts, args.concurrency, args.max_new_tokens)
            print(f"{'borrowing' if waiting else 'own core'} {tps:.1f} tok/s", flush=True)
            return tps

        async def warmup() -> None:
            await round_tps(server.url, prompts[: args.concurrency], args.concurrency, 8)

        cmp = await ainterleaved(args.rounds, lambda: run(False), lambda: run(True), warmup=warmup)
    finally:
        flag.unlink(missing_ok=True)
        server.stop()
        pin_to_cores(cores)
    borrowed = [line for line in log.read_text(errors="replace").splitlines() if "agentrl: borrowed cores" in line]
    lo, hi = cmp.range
    print(f"{args.requests} requests of ~{args.prompt_tokens} prompt tokens, {args.max_new_tokens} new tokens each, "
          f"concurrency {args.concurrency}, model {args.model} ({dtype}); server and client on core {own[0]}, "
          f"core {lend[0]} lent while the flag is up; borrowing / own per round: median {cmp.median:.3f}, range "
          f"{lo:.3f}-{hi:.3f}; the server logged {len(borrowed)} borrowing spells"
          + ("" if args.rounds >= MIN_ROUNDS else f"; only {args.rounds} rounds: a check, not a figure to quote"))
    print(last_line({**cmp.fields("borrow_vs_own"), "tokens_per_s": statistics.median(cmp.ours),
                     "own_tokens_per_s": statistics.median(cmp.base), "model": args.model,
                     "requests": args.requests, "concurrency": args.concurrency,
                     "max_new_tokens": args.max_new_tokens}, env))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_load_arguments(p)
    p.add_argument("--dtype", default="auto", help="auto: as the demo resolves it on this CPU (float32 or bfloat16)")
    asyncio.run(main(quick_load(p.parse_args())))
