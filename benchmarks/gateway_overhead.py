"""Gateway overhead: a multi-turn agent through the agent gateway vs the same turns as native episodes, on the
same SGLang server.

Both sides run through the production path, the :class:`RolloutScheduler` with groups of one sample at the same
concurrency: the native side with the :class:`EpisodeRunner` on a multi-turn environment (each turn answered by a
fixed user message, rendered as the chat template's delta), the agent side with the :class:`AgentRunner`, a
:class:`LocalGateway` in this process and an agent written with the official ``openai`` client that sends the
same conversation (the model's reply + the same user message) for the same number of turns. Same prompts, same
``max_new_tokens``, greedy; every turn is shaped by the same SGLang regex (``extra_body`` on the agent side), so
it ends with a stop rather than at the token budget (a native episode ends at a length stop, an agent does not)
and both sides generate the same tokens. What the ratio measures is everything the gateway adds: HTTP and the
client SDK, JSON, message canonicalisation and bridging, tool-call parsing, the session's commits. After an
untimed warm-up, ``--rounds`` rounds (≥ 7 for a figure to quote) alternate (the order flips every round); the
headline is the median of the per-round ratios gateway / native and its range (a range containing 1 is parity).
The server is started on the first CPU and this process (agents, gateway, scheduler) moved to the other.

The default model is the demo's (SmolLM2-135M-Instruct): turns cost what they cost in training here. With the
random ``tiny`` model a 10-token turn takes ~15 ms, and the per-request CPU shows most: on AMD EPYC the agent's
``openai`` SDK costs ~1.3 ms a request over raw httpx and the gateway (FastAPI, rendering, bridging) ~0.6 ms, which
native episodes pay neither of.

Prints a table, then the last line ``gateway_vs_native_ratio=… gateway_vs_native_ratio_range=… rounds=…
tokens_per_s=… native_tokens_per_s=… … cpu=… cores=… dtype=… commit=… sglang=…`` (benchmarks/_common.py).

Usage: .venv/bin/python benchmarks/gateway_overhead.py [--prompts 16] [--concurrency 8] [--turns 3]
       [--max-new-tokens 48] [--rounds 7] [--model smollm2-135m-instruct|tiny] [--transport inprocess|shared|own]
       [--url http://…  (use a running server)] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from typing import Any

import httpx
import openai
from _common import MIN_ROUNDS, ainterleaved, environment, last_line, start_pinned  # this folder's
from rollout_overhead import CountingSink, NoNewWeights  # this folder's (the script's directory is on sys.path)

from agentrl.async_rollout import EpisodeBudget, EpisodeRunner, RolloutConfig, RolloutScheduler
from agentrl.async_rollout.agent_episode import AgentRunner
from agentrl.engine import SamplingParams, SGLangClient, SGLangServer, SGLangServerConfig
from agentrl.env.agent import ClientConfig, agent_factory
from agentrl.env.base import Environment, Observation, StepResult
from agentrl.env.registry import EnvResources
from agentrl.gateway import GatewayConfig, LocalGateway
from agentrl.hardware import engine_dtype
from agentrl.models import resolve_model
from agentrl.rewards import RewardInput, RewardResult
from agentrl.tokenizer import ChatTokenizer
from agentrl.types import Task

WORDS = ["alpha", "beta", "gamma", "delta", "river", "mountain", "seven", "eleven", "purple", "quiet", "market"]
FOLLOW_UP = "Go on, and say a little more."
# one sentence of 4-8 short lowercase words, at most 32 characters: every turn ends with a stop within 48 tokens even
# at one token per character (a random tiny model's words of unbounded length ran into the token budget: the native
# episode then ended at its length stop after one turn while the agent went on, and the two sides did unequal work)
REGEX = r"[a-z]{1,3}( [a-z]{1,3}){3,7}\."


def make_tasks(n: int) -> list[Task]:
    return [Task(id=f"p{i}", prompt=f"Question {i}: tell me about {WORDS[i % len(WORDS)]} and "
                                     f"{WORDS[(3 * i + 1) % len(WORDS)]}.") for i in range(n)]


class Chat(Environment):
    """``turns`` model turns, each answered by the same user message."""

    name = "chat"

    def __init__(self, turns: int) -> None:
        self.turns, self.done = turns, 0

    async def reset(self, task: Task) -> list[dict[str, Any]]:
        return [{"role": "user", "content": task.prompt}]

    async def step(self, text: str) -> StepResult:
        self.done += 1
        if self.done >= self.turns:
            return StepResult(None, True)
        return StepResult(Observation(messages=({"role": "user", "content": FOLLOW_UP},)), False)

    async def score(self, response: RewardInput) -> RewardResult:
        return RewardResult.scored(0.0)


def chat_agent(turns: int, max_new: int, transport: str) -> Any:
    """The agent: a plain ``openai`` client per episode, whose HTTP client is (``transport``) ``inprocess``: the
    gateway's in-process client (``client.http_client``, no socket: what the README recommends for agents in the
    rollout process); ``shared``: one ``httpx.AsyncClient`` over loopback for every episode (what an agent would
    do whose gateway is in another process); ``own``: each episode's SDK client builds its own, whose SSL context
    alone costs ~20 ms of CPU even over plain http (certifi's bundle is loaded)."""
    pool: list[httpx.AsyncClient] = []

    def http(client: ClientConfig) -> httpx.AsyncClient | None:
        if transport == "inprocess":
            return client.http_client
        if transport == "own":
            return None
        if not pool:
            pool.append(httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)))
        return pool[0]

    async def run(task: Task, client: ClientConfig) -> str:
        messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
        llm = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0, timeout=600,
                                 http_client=http(client))
        async with contextlib.AsyncExitStack() as stack:
            if transport != "shared":  # the in-process client survives its SDK client's close
                await stack.enter_async_context(llm)
            for t in range(turns):
                reply = await llm.chat.completions.create(model=client.model, messages=messages,  # type: ignore[arg-type]
                                                          max_tokens=max_new, extra_body={"regex": REGEX})
                messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
                if t + 1 < turns:
                    messages.append({"role": "user", "content": FOLLOW_UP})
        return ""

    return run


async def no_reward(task: Task, response: RewardInput) -> RewardResult:
    return RewardResult.scored(0.0)


async def one_round(runner: Any, make_env: Any, client: SGLangClient, tasks: list[Task],
                    concurrency: int) -> tuple[int, float, float, int]:
    """Model tokens, wall seconds, CPU seconds of this process, trajectories."""
    sink = CountingSink()
    scheduler = RolloutScheduler(
        runner=runner, engine=client, make_env=make_env, env_name="chat", tasks=iter(tasks), sink=sink,
        weights=NoNewWeights(), config=RolloutConfig(n_samples=1, groups_per_step=len(tasks), max_staleness=0,
                                                     max_running_groups=concurrency))
    t0, c0 = time.perf_counter(), time.process_time()
    await scheduler.run(total_groups=len(tasks), final_version=0)
    return sink.tokens, time.perf_counter() - t0, time.process_time() - c0, sink.trajectories


def tokens_per_s(result: tuple[int, float, float, int]) -> float:
    return result[0] / result[1]


async def main(args: argparse.Namespace) -> None:
    model = resolve_model(args.model)
    tok = ChatTokenizer.from_pretrained(model)
    tasks = make_tasks(args.prompts)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0, regex=REGEX)
    budget = EpisodeBudget(max_turns=args.turns, max_response_tokens=1 << 16, max_context_tokens=1 << 16)
    server_cfg = SGLangServerConfig(model_path=str(model), max_total_tokens=32768)
    env = environment(dtype=engine_dtype(server_cfg.dtype, server_cfg.device) if args.url is None else "external",
                      packages=("sglang", "torch", "openai", "httpx", "fastapi"))
    server = None
    url, pinning = args.url, "none"
    if url is None:
        (server,), pinning = await start_pinned(SGLangServer(server_cfg).start)
        url = server.url
    try:
        async with SGLangClient(url) as client, \
                LocalGateway(client, tok, GatewayConfig(model_name=args.model)) as gateway:
            native = EpisodeRunner(client, tok, sampling, budget)
            agent = AgentRunner(gateway, tok, sampling, budget)
            agent_env = agent_factory(chat_agent(args.turns, args.max_new_tokens, args.transport),
                                      reward=no_reward)

            def native_round(ts: list[Task]) -> Any:
                return one_round(native, lambda: Chat(args.turns), client, ts, args.concurrency)

            def agent_round(ts: list[Task]) -> Any:
                return one_round(agent, lambda: agent_env(EnvResources()), client, ts, args.concurrency)

            async def warmup() -> None:  # the regex's grammar, the prefix cache, the gateway's first requests
                await native_round(tasks[: args.concurrency])
                await agent_round(tasks[: args.concurrency])

            cmp = await ainterleaved(args.rounds, lambda: native_round(tasks), lambda: agent_round(tasks),
                                     rate=tokens_per_s, warmup=warmup)
    finally:
        if server is not None:
            server.stop()
    print(f"{args.prompts} episodes × {args.turns} turns (≤ {args.max_new_tokens} new tokens each, greedy, regex-"
          f"shaped), concurrency {args.concurrency}, model {args.model}, pinned {pinning}")
    print(f"{'round':>5} {'native tok/s':>12} {'gateway tok/s':>13} {'ratio':>6} {'tokens native/gateway':>22} "
          f"{'client CPU ms/episode: native':>30} {'gateway':>8}")
    for r, ((nt, _, nc, _), (gt, _, gc, _)) in enumerate(zip(cmp.base, cmp.ours)):
        print(f"{r:>5} {tokens_per_s(cmp.base[r]):>12.1f} {tokens_per_s(cmp.ours[r]):>13.1f} {cmp.ratios[r]:>6.3f} "
              f"{f'{nt}/{gt}':>22} {1000 * nc / args.prompts:>30.2f} {1000 * gc / args.prompts:>8.2f}")
    n_tok, n_s = sum(x[0] for x in cmp.base), sum(x[1] for x in cmp.base)
    g_tok, g_s = sum(x[0] for x in cmp.ours), sum(x[1] for x in cmp.ours)
    if n_tok != g_tok:
        print(f"note: unequal work, native {n_tok} vs gateway {g_tok} tokens (the ratio is per token)")
    if any(x[3] != args.prompts for x in cmp.ours):
        print("note: some agent episodes forked (more trajectories than episodes)")
    n_cpu, g_cpu = (sum(x[2] for x in side) / (args.rounds * args.prompts) for side in (cmp.base, cmp.ours))
    lo, hi = cmp.range
    print(f"aggregate: native {n_tok / n_s:.1f} tok/s, gateway {g_tok / g_s:.1f} tok/s, ratio "
          f"{(g_tok / g_s) / (n_tok / n_s):.3f}; median of per-round ratios {cmp.median:.3f} (range {lo:.3f}-"
          f"{hi:.3f}: {'parity within noise' if cmp.parity else 'outside the noise'})"
          + ("" if args.rounds >= MIN_ROUNDS else f"; only {args.rounds} rounds: a check, not a figure to quote"))
    print(last_line({**cmp.fields("gateway_vs_native_ratio"), "tokens_per_s": g_tok / g_s,
                     "native_tokens_per_s": n_tok / n_s, "client_cpu_ms_per_episode": 1000 * g_cpu,
                     "native_client_cpu_ms_per_episode": 1000 * n_cpu, "transport": args.transport,
                     "model": args.model, "pinned": pinning}, env))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    p.add_argument("--transport", choices=("inprocess", "shared", "own"), default="inprocess",
                   help="the agents' HTTP client: the gateway's in-process one (no socket), one shared loopback "
                        "client, or each episode's own (its SSL context: ~20 ms CPU each)")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="the demo's model (default); 'tiny' (random, ~1.5 ms a token) isolates the per-request "
                        "overhead, where the agent's SDK alone costs more than the gateway")
    p.add_argument("--url", default=None, help="use a running SGLang server instead of starting one")
    p.add_argument("--quick", action="store_true", help="a check that the script runs: 4 episodes x 2 turns, "
                                                        "3 rounds (not a figure to quote)")
    a = p.parse_args()
    if a.quick:
        a.prompts, a.concurrency, a.turns, a.rounds = 4, 4, 2, 3
    asyncio.run(main(a))
