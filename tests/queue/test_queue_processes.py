"""Producers and consumers in separate processes, one of them killed: every entry is accounted for."""

from __future__ import annotations

import asyncio
import subprocess
from collections import Counter

import pytest
import redis.asyncio
from queue_support import make_trajectory, run_worker

from agentrl.queue import TrajectoryQueue

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]


def lines(proc: subprocess.Popen[str], timeout_s: float = 60) -> list[list[str]]:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err
    return [line.split() for line in out.splitlines()]


async def test_killed_consumer_loses_nothing(client: redis.asyncio.Redis, redis_url: str, name: str) -> None:
    sent = [make_trajectory(version=i % 4) for i in range(20)]
    await TrajectoryQueue(client, name).put(sent)
    victim = run_worker("read-and-hang", redis_url, name, "victim", "7")
    try:
        assert victim.stdout is not None
        read_by_victim = []
        for line in iter(victim.stdout.readline, ""):
            if line.strip() == "ready":
                break
            read_by_victim.append(line.split()[2])
        victim.kill()  # dies between read and ack: its step was never committed
        victim.wait(10)
    finally:
        victim.kill()
    assert len(read_by_victim) == 7
    restarted = TrajectoryQueue(client, name, consumer="victim")  # as a restarted trainer: same name, fresh object
    trained: list[str] = []
    async with asyncio.timeout(60):
        while entries := await restarted.read(5, timeout_s=0.05):
            trained.extend(e.trajectory.trajectory_id for e in entries)
            await restarted.ack([e.entry_id for e in entries])
    assert trained[:7] == read_by_victim  # its uncommitted entries first, in order
    counts = Counter(trained)
    assert set(counts) == {t.trajectory_id for t in sent}  # nothing lost
    assert max(counts.values()) == 1  # each trained on exactly once
    assert (await restarted.stats()).length == 0


async def test_two_producers_two_consumers_account_for_every_entry(client: redis.asyncio.Redis, redis_url: str,
                                                                   name: str) -> None:
    n = 60
    producers = [run_worker("produce", redis_url, name, str(n), tag, "16") for tag in ("a", "b")]  # small cap:
    consumers = [run_worker("consume", redis_url, name, "steady", "1000000"),  # backpressure across processes
                 run_worker("consume", redis_url, name, "quitter", "20")]  # dies with a batch read, not acked
    try:
        produced = [w[1] for p in producers for w in lines(p) if w[0] == "put"]
        await client.set(f"{name}:test-done", 1)
        outputs = [lines(c) for c in consumers]
    finally:
        for p in producers + consumers:
            p.kill()
    acked = [w[1] for out in outputs for w in out if w[0] == "acked"]
    abandoned = {w[1] for out in outputs for w in out if w[0] == "abandoned"}
    q = TrajectoryQueue(client, name)
    stats = await q.stats()
    pending_ids = [e[0] for e in await client.xrange(name)]
    pending = {(await client.xrange(name, i, i))[0][1][b"i"].decode() for i in pending_ids}
    assert len(produced) == 2 * n == len(set(produced))
    assert len(acked) == len(set(acked))  # no entry acknowledged twice
    assert set(acked).isdisjoint(pending)
    assert set(acked) | pending == set(produced)  # produced = acked + pending
    assert pending == abandoned  # what is left is exactly the quitter's unacknowledged batch
    assert stats.length == stats.pending == len(pending) and stats.dead_letters == 0
    assert stats.pending_per_consumer == ({"quitter": len(pending)} if pending else {})
