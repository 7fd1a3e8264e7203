"""Queue clients run as separate processes by the tests (one line on stdout per event, flushed).

    produce URL STREAM N TAG CAPACITY        put N trajectories in batches of 5; 'put <trajectory id>' each
    consume URL STREAM CONSUMER STOP_AFTER   read/ack until STREAM:test-done is set; 'acked <trajectory id>';
                                             after STOP_AFTER acks it reads one more batch and exits WITHOUT acking
                                             it ('abandoned <trajectory id>'), like a trainer dying mid-step
    read-and-hang URL STREAM CONSUMER COUNT  read COUNT entries, 'read <entry id> <trajectory id>', 'ready', hang
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import redis.asyncio

sys.path.insert(0, str(Path(__file__).parent))
from queue_support import make_trajectory

from agentrl.queue import TrajectoryQueue


def say(*words: object) -> None:
    print(*words, flush=True)


async def produce(url: str, stream: str, n: str, tag: str, capacity: str) -> None:
    async with redis.asyncio.Redis.from_url(url) as client:
        queue = TrajectoryQueue(client, stream, capacity=int(capacity))
        for start in range(0, int(n), 5):
            batch = [make_trajectory(version=i % 3, tag=tag) for i in range(start, min(start + 5, int(n)))]
            await queue.put(batch)
            for t in batch:
                say("put", t.trajectory_id)
    say("done")


async def consume(url: str, stream: str, consumer: str, stop_after: str) -> None:
    acked = 0
    async with redis.asyncio.Redis.from_url(url) as client:
        queue = TrajectoryQueue(client, stream, consumer=consumer)
        while True:
            entries = await queue.read(8, timeout_s=0.2)
            if not entries:
                if await client.exists(f"{stream}:test-done"):
                    return
                continue
            if acked >= int(stop_after):
                for e in entries:
                    say("abandoned", e.trajectory.trajectory_id)
                return
            await queue.ack([e.entry_id for e in entries])
            acked += len(entries)
            for e in entries:
                say("acked", e.trajectory.trajectory_id)


async def read_and_hang(url: str, stream: str, consumer: str, count: str) -> None:
    async with redis.asyncio.Redis.from_url(url) as client:
        queue = TrajectoryQueue(client, stream, consumer=consumer)
        got = 0
        while got < int(count):
            for e in await queue.read(int(count) - got, timeout_s=1.0):
                say("read", e.entry_id, e.trajectory.trajectory_id)
                got += 1
        say("ready")
        await asyncio.Event().wait()


if __name__ == "__main__":
    modes = {"produce": produce, "consume": consume, "read-and-hang": read_and_hang}
    asyncio.run(modes[sys.argv[1]](*sys.argv[2:]))
