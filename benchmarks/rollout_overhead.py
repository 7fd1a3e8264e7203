"""Rollout overhead: agentrl episodes vs raw concurrent ``/generate`` on the same SGLang server.

Both sides send the same prompts (chat-rendered, tokenised once for the raw side), at the same concurrency, for
the same work (``max_new_tokens`` with ``ignore_eos``, so every request generates exactly that many tokens) and
both ask for logprobs (RL needs them; ``--raw-without-logprobs`` drops them from the raw side). The agentrl side
is the production path: RolloutScheduler → EpisodeRunner (single turn, no tools, a constant reward so reward
cost is not measured here; see reward_bench.py) → SGLangClient, with groups of one sample. Each side keeps one
HTTP session for the whole benchmark (the raw side's ``aiohttp.ClientSession``, agentrl's ``SGLangClient``), so
neither pays connection set-up in a round. The server (the demo's SmolLM2-135M-Instruct unless ``--model``) is
started here on the first CPU and this process (the client) moved to the other (``--url``: a running server,
nothing pinned). After an untimed warm-up, ``--rounds`` rounds (≥ 7 for a figure to quote) alternate raw /
agentrl (the order flips every round); the headline is the median of the per-round ratios agentrl / raw and its
range: a range that contains 1 is parity (no difference beyond the noise). The client process's CPU per episode
is reported as well: it does not depend on the server's speed.

Prints a table, then the last line ``rollout_overhead_ratio=… rollout_overhead_ratio_range=… rounds=…
tokens_per_s=… raw_tokens_per_s=… … cpu=… cores=… dtype=… commit=… sglang=…`` (benchmarks/_common.py).

Usage: .venv/bin/python benchmarks/rollout_overhead.py [--prompts 32] [--concurrency 16] [--max-new-tokens 64]
       [--rounds 7] [--model smollm2-135m-instruct|tiny] [--url http://…  (use a running server)] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
from _common import MIN_ROUNDS, ainterleaved, environment, last_line, start_pinned  # this folder's

from agentrl.async_rollout import EpisodeBudget, EpisodeRunner, RolloutConfig, RolloutScheduler
from agentrl.engine import SamplingParams, SGLangClient, SGLangServer, SGLangServerConfig
from agentrl.env.base import Environment, StepResult
from agentrl.hardware import engine_dtype
from agentrl.models import resolve_model
from agentrl.rewards import RewardInput, RewardResult
from agentrl.tokenizer import ChatTokenizer
from agentrl.types import Task, Trajectory

WORDS = ["alpha", "beta", "gamma", "delta", "river", "mountain", "seven", "eleven", "purple", "quiet", "market"]


def make_tasks(n: int) -> list[Task]:
    return [Task(id=f"p{i}", prompt=f"Question {i}: tell me about {WORDS[i % len(WORDS)]} and "
                                     f"{WORDS[(3 * i + 1) % len(WORDS)]}.") for i in range(n)]


class OneTurn(Environment):
    name = "one_turn"

    async def reset(self, task: Task) -> list[dict[str, Any]]:
        return [{"role": "user", "content": task.prompt}]

    async def step(self, text: str) -> StepResult:
        return StepResult(None, True)

    async def score(self, response: RewardInput) -> RewardResult:
        return RewardResult.scored(0.0)


class CountingSink:
    def __init__(self) -> None:
        self.tokens = 0
        self.trajectories = 0

    async def put(self, trajectories: list[Trajectory]) -> list[str]:
        self.trajectories += len(trajectories)
        self.tokens += sum(t.num_model_tokens for t in trajectories)
        return []


class NoNewWeights:
    async def wait_for(self, min_version: int, *, timeout_s: float) -> Any:
        await asyncio.sleep(timeout_s)
        raise TimeoutError


async def raw_round(http: aiohttp.ClientSession, url: str, prompts: list[list[int]], concurrency: int,
                    max_new: int, logprobs: bool) -> tuple[int, float, float]:
    """Tokens generated, wall seconds, and CPU seconds of this (client) process."""
    sem = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(ids: list[int]) -> None:
        nonlocal tokens
        payload: dict[str, Any] = {"input_ids": ids, "sampling_params": {
            "max_new_tokens": max_new, "ignore_eos": True, "temperature": 1.0}}
        if logprobs:  # output logprobs only, as agentrl asks (prompt logprobs would be extra work)
            payload["return_logprob"] = True
            payload["logprob_start_len"] = -1
        async with sem, http.post(url + "/generate", json=payload) as r:
            out = await r.json()
        tokens += len(out["output_ids"])

    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one(p) for p in prompts))
    return tokens, time.perf_counter() - t0, time.process_time() - c0


async def agentrl_round(client: SGLangClient, tok: ChatTokenizer, tasks: list[Task], concurrency: int,
                        max_new: int) -> tuple[int, float, float]:
    runner = EpisodeRunner(client, tok, SamplingParams(max_new_tokens=max_new, ignore_eos=True, temperature=1.0),
                           EpisodeBudget(max_turns=1, max_response_tokens=max_new, max_context_tokens=1 << 20))
    sink = CountingSink()
    stream: Iterator[Task] = iter(tasks)
    scheduler = RolloutScheduler(
        runner=runner, engine=client, make_env=OneTurn, env_name="one_turn", tasks=stream, sink=sink,
        weights=NoNewWeights(),
        config=RolloutConfig(n_samples=1, groups_per_step=len(tasks), max_staleness=0,
                             max_running_groups=concurrency))
    t0, c0 = time.perf_counter(), time.process_time()
    await scheduler.run(total_groups=len(tasks), final_version=0)
    return sink.tokens, time.perf_counter() - t0, time.process_time() - c0


def tokens_per_s(result: tuple[int, float, float]) -> float:
    return result[0] / result[1]


async def main(args: argparse.Namespace) -> None:
    model = resolve_model(args.model)
    tok = ChatTokenizer.from_pretrained(model)
    tasks = make_tasks(args.prompts)
    prompts = [tok.encode_prompt([{"role": "user", "content": t.prompt}]) for t in tasks]
    server_cfg = SGLangServerConfig(model_path=str(model), max_total_tokens=32768)
    env = environment(dtype=engine_dtype(server_cfg.dtype, server_cfg.device) if args.url is None else "external",
                      packages=("sglang", "torch", "aiohttp", "httpx"))
    server = None
    url, pinning = args.url, "none"
    if url is None:
        (server,), pinning = await start_pinned(SGLangServer(server_cfg).start)
        url = server.url
    try:
        async with SGLangClient(url) as client, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
            async def warmup() -> None:  # kernels, the prefix cache, both sides' connection pools
                await raw_round(http, url, prompts[: args.concurrency], args.concurrency, 8, True)
                await agentrl_round(client, tok, tasks[: args.concurrency], args.concurrency, 8)

            cmp = await ainterleaved(
                args.rounds,
                lambda: raw_round(http, url, prompts, args.concurrency, args.max_new_tokens,
                                  not args.raw_without_logprobs),
                lambda: agentrl_round(client, tok, tasks, args.concurrency, args.max_new_tokens),
                rate=tokens_per_s, warmup=warmup)
    finally:
        if server is not None:
            server.stop()
    print(f"{args.prompts} prompts × {args.max_new_tokens} new tokens (ignore_eos), concurrency "
          f"{args.concurrency}, model {args.model}, raw logprobs: {not args.raw_without_logprobs}, pinned {pinning}")
    print(f"{'round':>5} {'raw tok/s':>10} {'agentrl tok/s':>13} {'ratio':>6} {'client CPU ms/episode: raw':>27} "
          f"{'agentrl':>8}")
    for r, ((_, _, rc), (_, _, ac)) in enumerate(zip(cmp.base, cmp.ours)):
        print(f"{r:>5} {tokens_per_s(cmp.base[r]):>10.1f} {tokens_per_s(cmp.ours[r]):>13.1f} {cmp.ratios[r]:>6.3f} "
              f"{1000 * rc / args.prompts:>27.2f} {1000 * ac / args.prompts:>8.2f}")
    raw_tokens, raw_s = sum(x[0] for x in cmp.base), sum(x[1] for x in cmp.base)
    our_tokens, our_s = sum(x[0] for x in cmp.ours), sum(x[1] for x in cmp.ours)
    if not raw_tokens == our_tokens == args.rounds * args.prompts * args.max_new_tokens:
        raise RuntimeError(f"unequal work: raw {raw_tokens} vs agentrl {our_tokens} tokens, expected "
                           f"{args.rounds * args.prompts * args.max_new_tokens} (ignore_eos not honoured?)")
    raw_cpu, our_cpu = (sum(x[2] for x in side) / (args.rounds * args.prompts) for side in (cmp.base, cmp.ours))
    raw_tps, our_tps = raw_tokens / raw_s, our_tokens / our_s
    lo, hi = cmp.range
    print(f"aggregate: raw {raw_tps:.1f} tok/s, agentrl {our_tps:.1f} tok/s, ratio {our_tps / raw_tps:.3f}; "
          f"median of per-round ratios {cmp.median:.3f} (range {lo:.3f}-{hi:.3f}: "
          f"{'parity within noise' if cmp.parity else 'outside the noise'})"
          + ("" if args.rounds >= MIN_ROUNDS else f"; only {args.rounds} rounds: a check, not a figure to quote"))
    print(f"client CPU per episode: raw {1000 * raw_cpu:.2f} ms, agentrl {1000 * our_cpu:.2f} ms")
    print(last_line({**cmp.fields("rollout_overhead_ratio"), "tokens_per_s": our_tps, "raw_tokens_per_s": raw_tps,
                     "aggregate_ratio": our_tps / raw_tps, "client_cpu_ms_per_episode": 1000 * our_cpu,
                     "raw_client_cpu_ms_per_episode": 1000 * raw_cpu, "model": args.model, "pinned": pinning}, env))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="the demo's model (default); 'tiny' (random) makes the per-request overhead show most")
    p.add_argument("--url", default=None, help="use a running SGLang server instead of starting one")
    p.add_argument("--raw-without-logprobs", action="store_true")
    p.add_argument("--quick", action="store_true", help="a check that the script runs: 8 prompts x 16 tokens, "
                                                        "3 rounds (not a figure to quote)")
    a = p.parse_args()
    if a.quick:
        a.prompts, a.concurrency, a.max_new_tokens, a.rounds = 8, 8, 16, 3
    asyncio.run(main(a))
