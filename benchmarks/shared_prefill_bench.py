"""A group's first turn on a real SGLang server: its samples sent together vs its prompt prefilled once first.

The rollout side starts the ``n_samples`` episodes of a group together with one prompt, on one server. SGLang looks
up its prefix cache when it schedules a request, so samples that arrive in one scheduling round each prefill the
whole prompt. ``SharedPrefill`` (agentrl/async_rollout/episode.py) sends one prefill-only request first and lets
the samples generate after it. Each round sends ``--groups`` groups of ``--samples`` requests (fresh random prompts
of ``--prompt-tokens``, ``--max-new-tokens`` each with ignore_eos, temperature 1.3 as the demo samples), all groups at
once, after flushing the server's cache; base = the samples sent together, ours = through ``SharedPrefill``. The
server is pinned to core 0 (as ``rollout_cores: [0]`` in the demo), the client to the rest.

Last line: ``shared_vs_together=…`` (median of per-round ratios of generated tokens/s, and its range),
``cached_share`` / ``together_cached_share`` (prompt tokens the server reported as cached, ``meta_info.cached_tokens``,
over prompt tokens sent).
Usage: .venv/bin/python benchmarks/shared_prefill_bench.py [--groups 6 --samples 8 --prompt-tokens 96] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _common import MIN_ROUNDS, ainterleaved, environment, last_line, start_pinned  # this folder's

from agentrl.async_rollout.episode import SharedPrefill
from agentrl.engine import SamplingParams, SGLangClient, SGLangServer, SGLangServerConfig
from agentrl.hardware import engine_dtype
from agentrl.models import resolve_model


@dataclass(frozen=True)
class Round:
    tokens_per_s: float
    cached_share: float


async def one_round(client: SGLangClient, args: argparse.Namespace, rng: random.Random, share: bool) -> Round:
    await client.flush_cache(wait_s=60)  # the last round's aborted requests may still be finishing
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.3, ignore_eos=True)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_tokens)] for _ in range(args.groups)]
    shared = SharedPrefill(client)

    async def group(i: int, prompt: list[int]) -> list[tuple[int, int]]:
        if share:
            await shared(f"group-{i}", prompt)
        outs = await asyncio.gather(*(client.generate(prompt, sampling) for _ in range(args.samples)))
        return [(len(o.output_ids), int(o.meta.get("cached_tokens", 0))) for o in outs]

    t0 = time.perf_counter()
    results = [r for g in await asyncio.gather(*(group(i, p) for i, p in enumerate(prompts))) for r in g]
    elapsed = time.perf_counter() - t0
    return Round(sum(n for n, _ in results) / elapsed,
                 sum(c for _, c in results) / (args.prompt_tokens * len(results)))


async def main(args: argparse.Namespace) -> None:
    model = resolve_model(args.model)
    dtype = engine_dtype(args.dtype, "cpu")
    env = environment(dtype=dtype, packages=("sglang", "torch"))
    server = SGLangServer(SGLangServerConfig(model_path=str(model), dtype=dtype, env={"OMP_NUM_THREADS": "1"}),
                          log_path=Path(tempfile.gettempdir()) / "shared_prefill_bench.log")
    rng = random.Random(0)
    try:
        _, pinning = await start_pinned(server.start)
        async with SGLangClient(server.url) as client:
            async def side(share: bool) -> Round:
                r = await one_round(client, args, rng, share)
                print(f"{'shared' if share else 'together'}: {r.tokens_per_s:.1f} tok/s, "
                      f"prompt cached {r.cached_share:.2f}", flush=True)
                return r

            cmp = await ainterleaved(args.rounds, lambda: side(False), lambda: side(True),
                                     rate=lambda r: r.tokens_per_s)
    finally:
        server.stop()
    print(f"{args.groups} groups x {args.samples} samples, {args.prompt_tokens}-token prompts, {args.max_new_tokens} "
          f"new tokens, {args.model} ({dtype}), server on 1 core (pinned {pinning})"
          + ("" if args.rounds >= MIN_ROUNDS else f"; only {args.rounds} rounds: a check, not a figure to quote"))
    print(last_line({**cmp.fields("shared_vs_together"),
                     "tokens_per_s": statistics.median(r.tokens_per_s for r in cmp.ours),
                     "together_tokens_per_s": statistics.median(r.tokens_per_s for r in cmp.base),
                     "cached_share": statistics.median(r.cached_share for r in cmp.ours),
                     "together_cached_share": statistics.median(r.cached_share for r in cmp.base),
                     "model": args.model, "groups": args.groups, "samples": args.samples,
                     "prompt_tokens": args.prompt_tokens, "max_new_tokens": args.max_new_tokens}, env))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    p.add_argument("--quick", action="store_true", help="2 groups x 4 samples, 2 rounds: a check that it runs")
    a = p.parse_args()
    if a.quick:
        a.groups, a.samples, a.rounds = 2, 4, 2
    asyncio.run(main(a))
