"""SGLang CPU generation throughput: with agentrl's CPU fast paths vs SGLang as it is.

Two real SGLang servers on the same model, one with ``AGENTRL_SGLANG_CPU_PATCHES=0`` (SGLang's torch-native
backend as shipped: per-request attention loop, torch.multinomial; the floor we started from) and one with the
fast paths of ``agentrl/engine/sgl_kernel_cpu/sgl_kernel/_fast_paths.py`` (batched decode attention, inverse-CDF
sampling; the default of every server agentrl starts on CPU). Each round sends the same ``--requests`` prompts of ~``--prompt-tokens`` tokens,
``--concurrency`` at a time, ``--max-new-tokens`` each (ignore_eos, with logprobs as RL asks), alternating which
server goes first. Servers are pinned to core 0 (as ``rollout_cores: [0]`` in the demo), the client to the rest.

``decode_mfu`` / ``native_decode_mfu``: model FLOPs per generated token (2 × the matmul parameters a token uses,
decoder and LM head, + attention's 4 · layers · context · hidden at the mean context of a generated token) ×
tokens/s ÷ the one-thread matmul rate in the server's dtype (:func:`agentrl.hardware.matmul_gflops`, the best of
3 before and of 3 after the rounds, averaged; the servers run on one core). Prompt (prefill) FLOPs are not counted,
so it understates the work done; it says how far decode is from the core's matmul rate, not a peak.

Last line: ``fast_vs_native=… tokens_per_s=… native_tokens_per_s=… decode_mfu=… native_decode_mfu=…`` (median of
per-round ratios, median tokens/s).
``--vs-env KEY=VALUE`` (repeatable) compares agentrl's server with those environment variables against agentrl's
server as it is (e.g. an allocator setting's cost in speed): ``env_vs_default=…`` then.

Usage: .venv/bin/python benchmarks/sglang_decode_bench.py [--model smollm2-135m-instruct] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

from _common import (  # this folder's
    MIN_ROUNDS,
    ainterleaved,
    decoder_matmul_params,
    environment,
    key_values,
    last_line,
    start_pinned,
)

from agentrl.engine import SamplingParams, SGLangClient, SGLangServer, SGLangServerConfig
from agentrl.hardware import engine_dtype, matmul_gflops
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


def random_prompts(args: argparse.Namespace) -> list[list[int]]:
    """``--requests`` prompts of random token ids, ``--prompt-tokens`` long on average (half to 1.5x), seeded."""
    rng = random.Random(0)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(args.prompt_tokens // 2, args.prompt_tokens * 3 // 2))]
            for _ in range(args.requests)]


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    """The load a decode benchmark sends (shared with engine_borrow_bench.py); :func:`quick_load` applies ``--quick``."""
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    p.add_argument("--max-total-tokens", type=int, default=65536,
                   help="each server's KV-cache size in tokens (its memory: ~46 KB a token in fp32 for the 135M model)")
    p.add_argument("--quick", action="store_true", help="a check that the script runs: 8 requests of ~64 prompt "
                                                        "tokens x 16 new, 2 rounds (not a figure to quote)")


def quick_load(a: argparse.Namespace) -> argparse.Namespace:
    if a.quick:
        a.requests, a.concurrency, a.prompt_tokens, a.max_new_tokens, a.rounds = 8, 8, 64, 16, 2
    return a


def decode_flops_per_token(model: Path, context: float) -> float:
    """2 × matmul parameters per token (attention and MLP projections, LM head) + 4 · layers · context · hidden."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model))
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    return 2 * (decoder_matmul_params(cfg) + h * cfg.vocab_size) + 4 * layers * context * h


def matmul_rate(dtype: str) -> float:
    """FLOP/s of one thread in ``dtype`` (``auto``, ``fp32``/``bf16`` or SGLang's ``float32``/``bfloat16``): the
    best of 3 (a shared machine slows some)."""
    served = engine_dtype(dtype, "cpu")
    trainer_name = {"float32": "fp32", "bfloat16": "bf16"}.get(served)
    if trainer_name is None:
        raise SystemExit(f"--dtype {dtype}: expected auto, float32/fp32 or bfloat16/bf16 (a CPU server's dtypes)")
    return max(matmul_gflops(trainer_name) for _ in range(3)) * 1e9  # type: ignore[arg-type]


async def main(args: argparse.Namespace) -> None:
    model = resolve_model(args.model)
    prompts = random_prompts(args)
    env = environment(dtype=args.dtype, packages=("sglang", "torch"))
    context = statistics.mean(len(p) + (args.max_new_tokens - 1) / 2 for p in prompts)  # a generated token's mean
    flops = decode_flops_per_token(model, context)
    rate_before = matmul_rate(args.dtype)
    vs_env = key_values(args.vs_env, "--vs-env")
    # the baseline: SGLang as shipped, or (--vs-env) agentrl's default server; the other: agentrl's (+ those variables)
    sides = ({"native": {"AGENTRL_SGLANG_CPU_PATCHES": "0"}, "fast": {}} if not vs_env
             else {"native": {}, "fast": vs_env})
    servers = {name: SGLangServer(SGLangServerConfig(
        model_path=str(model), dtype=args.dtype, max_total_tokens=args.max_total_tokens, env=side_env),
        log_path=Path(tempfile.gettempdir()) / f"sglang_decode_bench_{name}.log")
        for name, side_env in sides.items()}
    try:
        _, pinning = await start_pinned(*(s.start for s in servers.values()))  # on the first CPU; the client not

        async def warmup() -> None:
            for s in servers.values():
                await round_tps(s.url, prompts[: args.concurrency], args.concurrency, 8)

        async def one(name: str) -> float:
            tps = await round_tps(servers[name].url, prompts, args.concurrency, args.max_new_tokens)
            print(f"{name} {tps:.1f} tok/s", flush=True)
            return tps

        cmp = await ainterleaved(args.rounds, lambda: one("native"), lambda: one("fast"), warmup=warmup)
    finally:
        for s in servers.values():
            s.stop()
    rate = (rate_before + matmul_rate(args.dtype)) / 2
    tps, native_tps = statistics.median(cmp.ours), statistics.median(cmp.base)
    lo, hi = cmp.range
    print(f"{args.requests} requests of ~{args.prompt_tokens} prompt tokens, {args.max_new_tokens} new tokens each, "
          f"concurrency {args.concurrency}, model {args.model} ({args.dtype}), servers on 1 core (pinned {pinning}); "
          f"{'with env / default' if vs_env else 'fast / native'} per round: median {cmp.median:.3f}, range {lo:.3f}-{hi:.3f}"
          + ("" if args.rounds >= MIN_ROUNDS else f"; only {args.rounds} rounds: a check, not a figure to quote"))
    print(f"{flops / 1e6:.1f} MFLOP per generated token (mean context {context:.0f}), matmul rate "
          f"{rate / 1e9:.1f} GFLOP/s on one thread in {args.dtype}")
    load = {"model": args.model, "requests": args.requests, "concurrency": args.concurrency,
            "max_new_tokens": args.max_new_tokens}
    if vs_env:  # the same two servers but for the variables: their ratio, not the fast paths'
        print(last_line({**cmp.fields("env_vs_default"), "tokens_per_s": tps, "default_tokens_per_s": native_tps,
                         "env": ",".join(args.vs_env), **load}, env))
        return
    print(last_line({**cmp.fields("fast_vs_native"), "tokens_per_s": tps, "native_tokens_per_s": native_tps,
                     "decode_mfu": flops * tps / rate, "native_decode_mfu": flops * native_tps / rate,
                     "matmul_gflops": rate / 1e9, **load}, env))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_load_arguments(p)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--vs-env", action="append", default=[], metavar="KEY=VALUE",
                   help="compare agentrl's server with these environment variables (repeatable) against agentrl's "
                        "server as it is, instead of against SGLang as shipped; last line: env_vs_default=...")
    asyncio.run(main(quick_load(p.parse_args())))
