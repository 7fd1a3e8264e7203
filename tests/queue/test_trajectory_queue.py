"""TrajectoryQueue against real Redis servers (embedded 6.2 and Debian 7): delivery, ack, restart recovery,
backpressure, dead letters, stats."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import redis.asyncio
from queue_support import make_trajectory

from agentrl.errors import ConfigError, QueueError
from agentrl.queue import (
    QueueFullError,
    RetryPolicy,
    TrajectoryConsumer,
    TrajectoryProducer,
    TrajectoryQueue,
    codec,
    make_client,
)
from agentrl.queue._scripts import packed

pytestmark = pytest.mark.redis


def queue(client: redis.asyncio.Redis, name: str, consumer: str | None = "c1", **kw: object) -> TrajectoryQueue:
    return TrajectoryQueue(client, name, consumer=consumer, **kw)  # type: ignore[arg-type]


async def test_put_read_ack_round_trip(client: redis.asyncio.Redis, name: str) -> None:
    q = queue(client, name)
    assert isinstance(q, TrajectoryProducer) and isinstance(q, TrajectoryConsumer)
    sent = [make_trajectory(version=v) for v in (0, 1, 2)]
    ids = await q.put(sent)
    entries = await q.read(10, timeout_s=1)
    assert [e.entry_id for e in entries] == ids
    assert [e.trajectory for e in entries] == sent  # exact, field by field
    assert await q.ack(ids) == 3
    assert await q.ack(ids) == 0  # idempotent
    stats = await q.stats()
    assert (stats.length, stats.pending, stats.per_version) == (0, 0, {})  # acknowledged entries are trimmed
    assert await client.xlen(name) == 0
    assert await client.hlen(f"{name}:ids") == 0  # nothing left behind


async def test_a_stock_redis_py_client_moves_the_same_bytes(client: redis.asyncio.Redis, redis_url: str,
                                                               name: str) -> None:
    """Through make_client's client a payload goes out as the trajectory's pieces; through a stock redis-py client
    as one joined bytes: the stream holds the same payload either way, and either queue reads the other's."""
    stock = redis.asyncio.Redis.from_url(redis_url)
    try:
        sent = [make_trajectory(version=v) for v in (0, 1)]
        fast, plain = queue(client, name), queue(stock, name, consumer="c2")
        assert fast._send_pieces and not plain._send_pieces
        await fast.put(sent[:1])
        await plain.put(sent[1:])
        stored = [f[b"t"] for _, f in await client.xrange(name)]
        assert stored == [codec.to_msgpack(t) for t in sent]
        assert [e.trajectory for e in await plain.read(1, timeout_s=1)] == sent[:1]
        assert [e.trajectory for e in await fast.read(1, timeout_s=1)] == sent[1:]
    finally:
        await stock.aclose()


async def test_read_times_out_empty(client: redis.asyncio.Redis, name: str) -> None:
    assert await queue(client, name).read(4, timeout_s=0.05) == []
    assert await queue(client, name).read(4, timeout_s=0) == []


async def test_a_stream_deleted_under_the_consumer_gets_its_group_back(
        client: redis.asyncio.Redis, name: str) -> None:
    q = queue(client, name)
    await q.put([make_trajectory()])
    assert len(await q.read(4, timeout_s=0)) == 1  # the group exists now
    await client.delete(name)  # e.g. an operator's cleanup
    assert await q.read(4, timeout_s=0) == []  # non-blocking XREADGROUP: NOGROUP → group recreated
    await client.delete(name)
    assert await q.read(4, timeout_s=0.05) == []  # again, now also through the blocking XREADGROUP wait
    sent = make_trajectory()
    await queue(client, name, consumer=None).put([sent])
    assert [e.trajectory for e in await q.read(4, timeout_s=1)] == [sent]


async def test_put_is_idempotent_per_trajectory_id(client: redis.asyncio.Redis, name: str) -> None:
    q = queue(client, name)
    t = make_trajectory()
    first = await q.put([t])
    assert await q.put([t]) == first  # a producer retry after a lost reply does not duplicate
    assert await q.put([t, t]) == first * 2  # nor twice in one call
    assert (await q.stats()).length == 1


async def test_put_retried_after_a_lost_reply_adds_nothing_twice(client: redis.asyncio.Redis, name: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    q = queue(client, name, retry=RetryPolicy(attempts=3, base_delay_s=0.001))
    sent = [make_trajectory(tag=str(i)) for i in range(5)]
    real, lost = q._put_chunk, []

    async def reply_lost(chunk: list) -> list[str]:
        ids = await real(chunk)  # the server added them ...
        if not lost:
            lost.append(ids)
            raise redis.exceptions.ConnectionError("connection reset by peer")  # ... the reply never came
        return ids

    monkeypatch.setattr(q, "_put_chunk", reply_lost)
    ids = await q.put(sent)
    assert ids == lost[0]  # the retry found the entries the first try added
    assert [e.trajectory for e in await q.read(10, timeout_s=1)] == sent  # each once, in order
    assert (await q.stats()).per_version == {0: 5}  # and counted once


async def test_producer_dying_between_admit_and_add_leaves_no_lost_trajectory(client: redis.asyncio.Redis,
                                                                             name: str) -> None:
    await queue(client, name).put([make_trajectory(tag="other")])
    t = make_trajectory(tag="t")
    dying = queue(client, name)
    keys = [name, f"{name}:ids", f"{name}:versions"]
    args = [10, packed([t.trajectory_id]), packed(["3"])]
    assert await dying._admit(keys=keys, args=args) == [b""]  # admitted, marked, counted
    assert await client.hget(f"{name}:ids", t.trajectory_id) == b"3"  # ... and the producer dies before its XADD
    assert (await dying.stats()).per_version == {0: 1, 3: 1}  # (counted without its entry, for now)
    [entry_id] = await queue(client, name).put([t])  # its restart puts the trajectory again
    entries = await queue(client, name, consumer="c").read(10, timeout_s=1)
    assert [e.trajectory for e in entries][-1] == t and entries[-1].entry_id == entry_id
    assert await client.xlen(name) == await client.hlen(f"{name}:ids") == 2
    assert (await dying.stats()).per_version == {0: 2}  # the stale marker's count went with it: one entry each


async def test_restarted_consumer_gets_its_uncommitted_entries_first(client: redis.asyncio.Redis,
                                                                     name: str) -> None:
    sent = [make_trajectory(version=i) for i in range(6)]
    await queue(client, name, consumer=None).put(sent)
    before = await queue(client, name, consumer="trainer-0").read(3, timeout_s=1)
    # crash after committing a step that used before[0] (its id is in the checkpoint) but before acking it
    resumed = queue(client, name, consumer="trainer-0")
    assert await resumed.ack([before[0].entry_id]) == 1
    again = await resumed.read(10, timeout_s=1)
    assert [e.entry_id for e in again] == [e.entry_id for e in before[1:]]
    rest = await resumed.read(10, timeout_s=1)
    assert [e.trajectory for e in rest] == sent[3:]
    await resumed.ack([e.entry_id for e in again + rest])
    assert (await resumed.stats()).length == 0


async def test_full_queue_blocks_producers_until_acks(client: redis.asyncio.Redis, name: str) -> None:
    q = queue(client, name, capacity=4)
    await q.put([make_trajectory(tag=str(i)) for i in range(4)])
    extra = [make_trajectory(tag=f"x{i}") for i in range(3)]
    blocked = asyncio.create_task(q.put(extra))
    await asyncio.sleep(0.3)
    assert not blocked.done()
    assert (await q.stats()).length == 4  # nothing dropped, nothing over capacity
    first = await q.read(2, timeout_s=1)
    await q.ack([e.entry_id for e in first])
    async with asyncio.timeout(10):  # 2 of 3 get in ...
        while (await q.stats()).length < 4:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)  # (time for a wrong third put to land)
    assert not blocked.done() and (await q.stats()).length == 4  # ... and the third still waits
    nxt = await q.read(1, timeout_s=1)
    await q.ack([e.entry_id for e in nxt])
    ids = await asyncio.wait_for(blocked, 10)
    assert len(ids) == 3
    remaining = await q.read(10, timeout_s=1)
    assert [e.trajectory for e in remaining][-3:] == extra  # in order


async def test_full_queue_put_timeout_says_what_got_in(client: redis.asyncio.Redis, name: str) -> None:
    q = queue(client, name, capacity=2)
    batch = [make_trajectory(tag=str(i)) for i in range(3)]
    with pytest.raises(QueueFullError, match="stayed full") as err:
        await q.put(batch, timeout_s=0.2)
    assert len(err.value.enqueued_ids) == 2
    assert await client.xlen(name) == await client.hlen(f"{name}:ids") == 2  # the refused one left no trace
    assert [e.trajectory for e in await q.read(5, timeout_s=1)] == batch[:2]


async def test_malformed_payloads_go_to_dead_letters(client: redis.asyncio.Redis, name: str) -> None:
    q = queue(client, name)
    good = make_trajectory()
    await client.xadd(name, {"t": b"\xc1 not msgpack"})
    await q.put([good])
    await client.xadd(name, {"other": b"field"})
    await client.xadd(name, {"t": msgpack.packb({"schema": 999})})
    await client.xadd(name, {"i": "ghost", "v": "0"})  # an entry without a payload
    entries = await q.read(10, timeout_s=1)
    assert [e.trajectory for e in entries] == [good]  # the consumer survives and gets the good one
    stats = await q.stats()
    assert (stats.dead_letters, stats.pending, stats.length) == (4, 1, 1)
    dead = await client.xrange(f"{name}:dead")
    errors = [fields[b"error"].decode() for _, fields in dead]
    assert "msgpack" in errors[0] and "payload" in errors[1] and "schema 999" in errors[2]
    assert "no payload" in errors[3]
    assert dead[0][1][b"payload"] == b"\xc1 not msgpack"  # kept for inspection


async def test_stats_count_versions_pending_and_age(client: redis.asyncio.Redis, name: str) -> None:
    q = queue(client, name)
    no_model = make_trajectory(n_tokens=16, prompt_len=16)  # only prompt tokens: version -1
    await q.put([make_trajectory(version=1), make_trajectory(version=1), make_trajectory(version=2), no_model])
    first = await q.read(1, timeout_s=1)
    stats = await q.stats()
    assert stats.per_version == {1: 2, 2: 1, -1: 1}
    assert (stats.length, stats.pending, stats.waiting, stats.capacity) == (4, 1, 3, 1024)
    assert stats.pending_per_consumer == {"c1": 1}
    assert stats.oldest_age_s is not None and stats.oldest_age_s >= 0
    await q.ack([first[0].entry_id])
    assert (await q.stats()).per_version == {1: 1, 2: 1, -1: 1}


async def test_ack_of_a_large_batch_forgets_every_entry(client: redis.asyncio.Redis, name: str) -> None:
    """Over a thousand entries in one ack (the script deletes them in slices), some whose fields this consumer
    never saw (a restarted consumer acking its predecessor's reads: the script reads them from the stream)."""
    q = queue(client, name, capacity=5000)
    sent = [make_trajectory(version=k % 3, n_tokens=8, prompt_len=4) for k in range(2100)]
    ids = await q.put(sent)
    got = []
    while len(got) < len(sent):
        got += await q.read(1000, timeout_s=1)
    assert sorted(e.entry_id for e in got) == sorted(ids)
    fresh = queue(client, name)  # same consumer name, empty memory of deliveries
    assert await fresh.ack(ids[:50]) == 50
    assert (await q.stats()).per_version == {0: 683, 1: 683, 2: 684}
    assert await q.ack(ids) == 2050
    stats = await q.stats()
    assert (stats.length, stats.pending, stats.per_version) == (0, 0, {})
    assert await client.hlen(f"{name}:ids") == 0


async def test_read_needs_a_consumer_name(client: redis.asyncio.Redis, name: str) -> None:
    with pytest.raises(ConfigError, match="consumer name"):
        await queue(client, name, consumer=None).read(1, timeout_s=0)


async def test_rejects_decoding_client(redis_url: str, name: str) -> None:
    c = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
    with pytest.raises(ConfigError, match="decode_responses"):
        TrajectoryQueue(c, name)
    await c.aclose()


async def test_producer_gives_up_on_unreachable_redis(name: str) -> None:
    c = make_client("unix:///nonexistent/agentrl/redis.sock")
    q = TrajectoryQueue(c, name, retry=RetryPolicy(attempts=3, base_delay_s=0.001))
    with pytest.raises(QueueError, match="failed 3 times"):
        await q.put([make_trajectory()])
    await c.aclose()


async def test_entry_deleted_behind_the_queues_back_is_surfaced(client: redis.asyncio.Redis, name: str) -> None:
    sent = [make_trajectory(tag=str(i)) for i in range(3)]
    ids = await queue(client, name).put(sent)
    await queue(client, name, consumer="a").read(3, timeout_s=1)  # ... and the consumer dies before its ack
    await client.xdel(name, ids[0])  # someone trimmed the stream by hand
    restarted = queue(client, name, consumer="a")
    got = await restarted.read(10, timeout_s=0)  # its own pending entries: the deleted one is dead-lettered
    assert [e.trajectory for e in got] == sent[1:]
    dead = await client.xrange(f"{name}:dead")
    assert [(f[b"id"].decode(), f[b"error"].decode()) for _, f in dead] == [
        (ids[0], "the entry was deleted from the stream before it was acknowledged")]
    stats = await restarted.stats()
    assert (stats.pending, stats.dead_letters) == (2, 1)
    assert await restarted.read(10, timeout_s=0) == []  # nothing else
