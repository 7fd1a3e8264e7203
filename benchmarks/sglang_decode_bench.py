"""SGLang CPU generation throughput: with agentrl's CPU fast paths vs SGLang as it is.

Two real SGLang servers on the same model, one with ``AGENTRL_SGLANG_CPU_PATCHES=0`` (SGLang's torch-native
backend as shipped: per-request attention loop, torch.multinomial; the floor we started from) and one with the
fast paths of ``agentrl/engine/sgl_kernel_cpu/sgl_kernel/_fast_paths.py`` (batched decode attention, inverse-CDF
sampling; the default of every server agentrl starts on CPU). Each round sends the same ``--requests`` prompts of ~``--prompt-tokens`` tokens,
``--concurrency`` at a time, ``--max-new-tokens`` each (ignore_eos, with logprobs as RL asks), alternating which
server goes first. Servers are pinned to core 0 (as ``rollout_cores: [0]`` in the demo), the client to the rest.

Last line: ``fast_vs_native=… tokens_per_s=… native_tokens_per_s=…`` (median of per-round ratios).
Usage: .venv/bin/python benchmarks/sglang_decode_bench.py [--model smollm2-135m-instruct] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from agentrl.engine import SamplingParams, SGLangClient, SGLangServer, SGLangServerConfig
from agentrl.models import resolve_model


async def round_tps(url: str, prompts: list[list[int]], concurrency: int, max_new: int) -> float:
    sem = asyncio.Semaphore(concurrency)
    sampling = SamplingParams(max_new_tokens=max_new, temperature=1.0, ignore_eos=True)

    async with SGLangClient(url) as client:
        async def one(p: list[int]) -> int:
            async with sem:
                return len((await client.generate(p, sampling)).output_ids)

        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
        return tokens / (time.perf_counter() - t0)


async def main(args: argparse.Namespace) -> None:
    model = resolve_model(args.model)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(args.prompt_tokens // 2, args.prompt_tokens * 3 // 2))]
               for _ in range(args.requests)]
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[0]})  # the servers inherit core 0 ...
    servers = {name: SGLangServer(SGLangServerConfig(
        model_path=str(model), dtype=args.dtype, max_total_tokens=65536,
        env={"AGENTRL_SGLANG_CPU_PATCHES": flag}), log_path=Path(tempfile.gettempdir()) / f"sglang_decode_bench_{name}.log")
        for name, flag in (("native", "0"), ("fast", "1"))}
    try:
        for s in servers.values():
            await asyncio.to_thread(s.start)
        os.sched_setaffinity(0, set(cpus[1:] or cpus))  # ... the client does not compete with them
        for s in servers.values():
            await round_tps(s.url, prompts[: args.concurrency], args.concurrency, 8)  # warm-up
        rates: dict[str, list[float]] = {"native": [], "fast": []}
        for r in range(args.rounds):
            for name in (("native", "fast") if r % 2 == 0 else ("fast", "native")):
                rates[name].append(await round_tps(servers[name].url, prompts, args.concurrency, args.max_new_tokens))
            print(f"round {r}: native {rates['native'][-1]:.1f} tok/s, fast paths {rates['fast'][-1]:.1f} tok/s",
                  flush=True)
    finally:
        for s in servers.values():
            s.stop()
    ratio = statistics.median(f / n for f, n in zip(rates["fast"], rates["native"]))
    print(f"{args.requests} requests of ~{args.prompt_tokens} prompt tokens, {args.max_new_tokens} new tokens each, "
          f"concurrency {args.concurrency}, model {args.model} ({args.dtype}), server on 1 core")
    print(f"fast_vs_native={ratio:.2f} tokens_per_s={statistics.median(rates['fast']):.1f} "
          f"native_tokens_per_s={statistics.median(rates['native']):.1f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(p.parse_args()))
