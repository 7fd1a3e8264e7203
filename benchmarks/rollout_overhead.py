"""Rollout overhead: agentrl episodes vs raw concurrent ``/generate`` on the same SGLang server.

Both sides send the same prompts (chat-rendered, tokenised once for the raw side), at the same concurrency, for
the same work (``max_new_tokens`` with ``ignore_eos``, so every request generates exactly that many tokens) and
both ask for logprobs (RL needs them; ``--raw-without-logprobs`` drops them from the raw side). The agentrl side
is the production path: RolloutScheduler → EpisodeRunner (single turn, no tools, a constant reward so reward
cost is not measured here; see reward_bench.py) → SGLangClient, with groups of one sample. Rounds alternate
raw / agentrl (the order flips every round) to spread the noise of a shared machine; the headline ratio is the
median of the per-round ratios (robust to load that drifts between rounds), the aggregate is printed too. The
client process's CPU per episode is reported as well: it does not depend on the server's speed. The server (tiny
model unless ``--model``) is started here and stopped at the end.

Prints a table, then the last line ``rollout_overhead_ratio=… tokens_per_s=… raw_tokens_per_s=… …``.

Usage: .venv/bin/python benchmarks/rollout_overhead.py [--prompts 32] [--concurrency 16] [--max-new-tokens 64]
       [--rounds 6] [--model tiny] [--url http://…  (use a running server)]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Iterator
from typing import Any

import aiohttp

from agentrl.async_rollout import EpisodeBudget, EpisodeRunner, RolloutConfig, RolloutScheduler
from agentrl.engine import SamplingParams, SGLangClient, SGLangServer, SGLangServerConfig
from agentrl.env.base import Environment, StepResult
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


async def raw_round(url: str, prompts: list[list[int]], concurrency: int, max_new: int,
                    logprobs: bool) -> tuple[int, float, float]:
    """Tokens generated, wall seconds, and CPU seconds of this (client) process."""
    sem = asyncio.Semaphore(concurrency)
    tokens = 0

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
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


async def main(args: argparse.Namespace) -> None:
    model = resolve_model(args.model)
    tok = ChatTokenizer.from_pretrained(model)
    tasks = make_tasks(args.prompts)
    prompts = [tok.encode_prompt([{"role": "user", "content": t.prompt}]) for t in tasks]
    server = None
    url = args.url
    if url is None:
        server = SGLangServer(SGLangServerConfig(model_path=str(model), max_total_tokens=32768))
        await asyncio.to_thread(server.start)
        url = server.url
    try:
        async with SGLangClient(url) as client:
            await raw_round(url, prompts[: args.concurrency], args.concurrency, 8, True)  # warm-up
            await agentrl_round(client, tok, tasks[: args.concurrency], args.concurrency, 8)
            rows = []
            for r in range(args.rounds):  # the order alternates so that drifting load favours neither side
                if r % 2:
                    ours = await agentrl_round(client, tok, tasks, args.concurrency, args.max_new_tokens)
                raw = await raw_round(url, prompts, args.concurrency, args.max_new_tokens,
                                      not args.raw_without_logprobs)
                if not r % 2:
                    ours = await agentrl_round(client, tok, tasks, args.concurrency, args.max_new_tokens)
                rows.append((r, raw, ours))
    finally:
        if server is not None:
            server.stop()
    print(f"{args.prompts} prompts × {args.max_new_tokens} new tokens (ignore_eos), concurrency "
          f"{args.concurrency}, model {args.model}, raw logprobs: {not args.raw_without_logprobs}")
    print(f"{'round':>5} {'raw tok/s':>10} {'agentrl tok/s':>13} {'ratio':>6} {'client CPU ms/episode: raw':>27} "
          f"{'agentrl':>8}")
    for r, (rt, rs, rc), (at, as_, ac) in rows:
        print(f"{r:>5} {rt / rs:>10.1f} {at / as_:>13.1f} {(at / as_) / (rt / rs):>6.3f} "
              f"{1000 * rc / args.prompts:>27.2f} {1000 * ac / args.prompts:>8.2f}")
    raw_tokens, raw_s = sum(x[1][0] for x in rows), sum(x[1][1] for x in rows)
    our_tokens, our_s = sum(x[2][0] for x in rows), sum(x[2][1] for x in rows)
    assert raw_tokens == our_tokens == args.rounds * args.prompts * args.max_new_tokens, "unequal work"
    raw_cpu, our_cpu = (sum(x[i][2] for x in rows) / (args.rounds * args.prompts) for i in (1, 2))
    raw_tps, our_tps = raw_tokens / raw_s, our_tokens / our_s
    median = statistics.median((at / as_) / (rt / rs) for _, (rt, rs, _), (at, as_, _) in rows)
    print(f"aggregate: raw {raw_tps:.1f} tok/s, agentrl {our_tps:.1f} tok/s, ratio {our_tps / raw_tps:.3f}; "
          f"median of per-round ratios {median:.3f}")
    print(f"client CPU per episode: raw {1000 * raw_cpu:.2f} ms, agentrl {1000 * our_cpu:.2f} ms")
    print(f"rollout_overhead_ratio={median:.3f} tokens_per_s={our_tps:.1f} raw_tokens_per_s={raw_tps:.1f} "
          f"aggregate_ratio={our_tps / raw_tps:.3f} client_cpu_ms_per_episode={1000 * our_cpu:.2f} "
          f"raw_client_cpu_ms_per_episode={1000 * raw_cpu:.2f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--model", default="tiny")
    p.add_argument("--url", default=None, help="use a running SGLang server instead of starting one")
    p.add_argument("--raw-without-logprobs", action="store_true")
    asyncio.run(main(p.parse_args()))
