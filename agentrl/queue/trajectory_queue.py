"""The durable trajectory queue: one Redis stream, one consumer group of trainers, many producers.

Lifecycle of an entry: ``put`` adds it (waiting while ``capacity`` entries are unacknowledged: backpressure,
never a drop) → ``read`` delivers it to one consumer, where it stays *pending* → the trainer trains on it,
commits the step, then ``ack`` deletes it. A payload that cannot be decoded (or an entry deleted behind the
queue's back) is moved to the dead-letter stream ``<stream>:dead`` with the reason (and logged, and counted in
``stats().dead_letters``): never lost silently, never crashing the trainer.

Exactly-once training, and the trainer's queue position in a checkpoint:

1. ``read`` → train → **commit the step, recording its entry ids in the checkpoint** → ``ack(ids)``.
2. On resume, before the first read: ``ack(checkpoint.entry_ids)`` (idempotent; covers a crash between commit
   and ack), then ``read``: a queue whose consumer name was used before first re-delivers that consumer's own
   unacknowledged entries (read before the crash, never committed), then new ones. The consumer group itself
   (last delivered id + pending list) is the rest of the position, and it lives in Redis (AOF). So the consumer
   name must be stable across restarts (the trainer reads as ``trainer-0``).

A producer's retry after a lost reply cannot duplicate: ``put`` skips trajectory ids already in the stream.
Payloads travel inline in the stream entry; no Lua script touches them on the hot path (every key, and why:
``_scripts.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from functools import partial
from types import TracebackType
from typing import Any, Self

import redis.asyncio
import redis.exceptions

from agentrl.errors import ConfigError, QueueError
from agentrl.queue import _scripts, codec
from agentrl.queue._connection import Pieces, sends_pieces
from agentrl.queue.base import QueueEntry, QueueFullError, QueueStats
from agentrl.queue.retry import RetryPolicy
from agentrl.types import SchemaError, Trajectory

log = logging.getLogger(__name__)

_MAX_REMEMBERED = 100_000  # delivered entries whose side-table fields ack() can pass (else the server reads them)
_RawEntry = tuple[Any, Any]  # (entry id, {field: value}) as redis-py returns it; fields None or {} if deleted
_UNKNOWN = (b"", b"")  # (trajectory id, version) of an entry not delivered to this queue object
_DELETED = "the entry was deleted from the stream before it was acknowledged"


class TrajectoryQueue:
    """A :class:`~agentrl.queue.base.TrajectoryProducer` and :class:`~agentrl.queue.base.TrajectoryConsumer`
    on a Redis stream. ``consumer`` (a stable name per trainer rank) is needed only to read."""

    def __init__(self, redis_client: redis.asyncio.Redis, stream: str, *, group: str = "trainer",
                 consumer: str | None = None, capacity: int = 1024, retry: RetryPolicy | None = None,
                 op_timeout_s: float = 30.0, full_poll_s: float = 0.05,
                 max_batch_bytes: int = 16 << 20, dead_letter_maxlen: int = 10_000) -> None:
        if capacity < 1:
            raise ConfigError(f"queue capacity must be >= 1, got {capacity}")
        kwargs = redis_client.get_connection_kwargs()
        if kwargs.get("decode_responses") or str(kwargs.get("protocol") or 2) != "2":
            raise ConfigError("the trajectory queue needs a Redis client with decode_responses=False and "
                              "protocol 2 (payloads are binary msgpack); create it with the defaults")
        self._redis = redis_client
        self.stream, self.group, self.consumer, self.capacity = stream, group, consumer, capacity
        self._dead = f"{stream}:dead"
        self._keys = [stream, f"{stream}:versions", f"{stream}:ids"]
        self._retry = retry or RetryPolicy()
        self._op_timeout_s = op_timeout_s
        self._full_poll_s, self._max_batch_bytes = full_poll_s, max_batch_bytes
        self._dead_maxlen = dead_letter_maxlen
        self._admit = redis_client.register_script(_scripts.ADMIT)
        self._drop_stale = redis_client.register_script(_scripts.DROP_STALE)
        self._ack = redis_client.register_script(_scripts.ACK)
        self._dead_letter = redis_client.register_script(_scripts.DEAD_LETTER)
        self._send_pieces = sends_pieces(redis_client)  # payloads go out as the trajectory's own buffers
        self._group_ready = False
        self._delivered: dict[str, tuple[bytes, bytes]] = {}  # entry id -> (trajectory id, version), until acked
        self._recover_from: str | None = "0"  # own pending entries are re-delivered first (restart recovery)

    # ---- producer -------------------------------------------------------------------------------------------

    async def put(self, trajectories: Sequence[Trajectory], *, timeout_s: float | None = None) -> list[str]:
        """Enqueue ``trajectories`` in order and return their entry ids; wait while the queue is full.

        Raises QueueFullError after ``timeout_s`` (None: wait as long as it takes) with the ids that got in.
        """
        await self._ensure_group()
        encode = _as_pieces if self._send_pieces else codec.to_msgpack
        items = [(t.trajectory_id, str(_oldest_version(t)), encode(t)) for t in trajectories]
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        ids: list[str] = []
        while items:
            chunk = self._chunk(items)
            admitted = await self._call(partial(self._put_chunk, chunk), "put")
            ids.extend(admitted)
            items = items[len(admitted):]
            if items and len(admitted) < len(chunk):
                await self._wait_for_room(deadline, ids, len(ids) + len(items))
        return ids

    async def _put_chunk(self, chunk: list[tuple[str, str, bytes | Pieces]]) -> list[str]:
        """ADMIT (mark and count) the leading entries that fit, then add them (see _scripts); their entry ids.

        A retry of the whole call after a lost reply is safe: ADMIT answers '+' for what the first try added."""
        firsts: dict[str, int] = {}  # a trajectory id twice in one call is queued once
        for k, (tid, _, _) in enumerate(chunk):
            firsts.setdefault(tid, k)
        distinct = [chunk[k] for k in sorted(firsts.values())]
        reply = await self._admit(keys=[self.stream, self._keys[2], self._keys[1]],
                                  args=[self.capacity, _scripts.packed([tid for tid, _, _ in distinct]),
                                        _scripts.packed([version for _, version, _ in distinct])])
        status = dict(zip((tid for tid, _, _ in distinct), (_str(r) for r in reply)))
        fresh = [item for item in distinct if status.get(item[0]) == ""]
        if fresh:  # marked and counted by ADMIT: now the entries (a pipeline, not a MULTI: see _scripts)
            async with self._redis.pipeline(transaction=False) as pipe:
                for tid, version, payload in fresh:
                    pipe.xadd(self.stream, {"i": tid, "v": version, "t": payload})  # type: ignore[dict-item]
                added = await pipe.execute()
            for (tid, _, _), entry_id in zip(fresh, added):
                status[tid] = _str(entry_id)
        if any(v == "+" for v in status.values()):
            await self._find_queued(status)
        out = []
        for tid, _, _ in chunk:  # the admitted prefix, in order
            if not status.get(tid):
                break
            out.append(status[tid])
        return out

    async def _find_queued(self, status: dict[str, str]) -> None:
        """Entry ids of trajectories ADMIT says are already queued ('+'): a put retried after its reply was lost.
        Rare, so a scan of the stream is fine. A marker without its entry (a producer died between ADMIT and its
        XADDs, or the stream was deleted behind our back) is dropped and the trajectory admitted again by the
        caller's next round."""
        wanted = {tid for tid, v in status.items() if v == "+"}
        start: Any = "-"
        while wanted:
            batch = await self._redis.xrange(self.stream, min=start, count=256) or []  # the stub allows None
            for entry_id, fields in batch:
                tid = _str((fields or {}).get(b"i", b""))
                if tid in wanted:
                    status[tid] = _str(entry_id)
                    wanted.discard(tid)
            if len(batch) < 256:
                break
            start = "(" + _str(batch[-1][0])
        if wanted:  # stale markers (and the counts ADMIT made for them)
            await self._drop_stale(keys=[self._keys[2], self._keys[1]], args=sorted(wanted))
            status.update(dict.fromkeys(wanted, ""))
            log.warning("queue %r: %d stale 'already queued' markers dropped", self.stream, len(wanted))

    def _chunk(self, items: list[tuple[str, str, bytes | Pieces]]) -> list[tuple[str, str, bytes | Pieces]]:
        size, n = 0, 0
        for _, _, payload in items[: self.capacity]:
            size += len(payload)
            if n and size > self._max_batch_bytes:
                break
            n += 1
        return items[:n]

    async def _wait_for_room(self, deadline: float | None, ids: list[str], total: int) -> None:
        loop = asyncio.get_running_loop()
        delay = min(0.005, self._full_poll_s)
        while True:
            length = await self._call(lambda: self._redis.xlen(self.stream), "queue length")
            if length < self.capacity:
                return
            if deadline is not None and loop.time() >= deadline:
                raise QueueFullError(
                    f"queue {self.stream!r} stayed full ({length} unacknowledged of capacity {self.capacity}); "
                    f"{len(ids)} of {total} trajectories were enqueued, the rest were not. Expected the trainer "
                    "to acknowledge entries: is it running and acking after each step?", ids)
            await asyncio.sleep(delay if deadline is None else max(0.0, min(delay, deadline - loop.time())))
            delay = min(delay * 2, self._full_poll_s)

    # ---- consumer -------------------------------------------------------------------------------------------

    async def read(self, count: int, *, timeout_s: float) -> list[QueueEntry]:
        """Up to ``count`` entries for this consumer, waiting up to ``timeout_s`` for the first (0: no wait).

        The first calls on a fresh queue object return this consumer's own unacknowledged entries (a restarted
        trainer's uncommitted work) before any new one.
        """
        consumer = self._require_consumer()
        await self._ensure_group()
        while self._recover_from is not None:
            raw = await self._xreadgroup(consumer, self._recover_from, count, None)
            if not raw:
                self._recover_from = None
                break
            self._recover_from = _str(raw[-1][0])
            entries = await self._decode(raw, recovered=True)
            if entries:
                return entries
        raw = await self._xreadgroup(consumer, ">", count, max(1, int(timeout_s * 1000)) if timeout_s > 0 else None)
        return await self._decode(raw)

    async def ack(self, entry_ids: Sequence[str]) -> int:
        """Acknowledge and delete entries (after the step that used them is committed). Idempotent; returns
        how many were pending."""
        if not entry_ids:
            return 0
        # fields we saw at delivery spare the server from reading the entry back
        tids, versions = zip(*(self._delivered.get(eid, _UNKNOWN) for eid in entry_ids))
        args: list[Any] = [self.group, _scripts.packed(list(entry_ids)), _scripts.packed(tids),
                           _scripts.packed(versions)]
        acked = int(await self._call(lambda: self._ack(keys=self._keys, args=args), "ack"))
        for eid in entry_ids:
            self._delivered.pop(eid, None)
        return acked

    async def stats(self) -> QueueStats:
        """Length, pending, oldest age, per-version counts and dead letters, from one MULTI."""
        await self._ensure_group()

        async def snapshot() -> list[Any]:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.xlen(self.stream)
                pipe.xpending(self.stream, self.group)
                pipe.xrange(self.stream, count=1)
                pipe.hgetall(self._keys[1])
                pipe.xlen(self._dead)
                pipe.time()
                return await pipe.execute()

        length, pending, first, versions, dead, (sec, usec) = await self._call(snapshot, "stats")
        oldest = None
        if first:
            oldest = max(0.0, sec + usec / 1e6 - int(_str(first[0][0]).split("-")[0]) / 1000)
        return QueueStats(
            length=length, pending=pending["pending"], capacity=self.capacity, oldest_age_s=oldest,
            per_version={int(v): int(n) for v, n in versions.items()},
            pending_per_consumer={_str(c["name"]): int(c["pending"]) for c in pending["consumers"]},
            dead_letters=dead)

    async def aclose(self) -> None:
        """Nothing to release: the Redis client belongs to whoever created it (see RedisHandle)."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    # ---- helpers ----------------------------------------------------------------------------------------------

    async def _call(self, op: Any, what: str) -> Any:
        async def bounded() -> Any:
            async with asyncio.timeout(self._op_timeout_s):
                return await op()
        return await self._retry.call(bounded, what=f"{what} on queue {self.stream!r}")

    async def _xreadgroup(self, consumer: str, start: str, count: int, block_ms: int | None) -> list[_RawEntry]:
        async def op() -> Any:
            async with asyncio.timeout(self._op_timeout_s + (block_ms or 0) / 1000):
                return await self._redis.xreadgroup(self.group, consumer, {self.stream: start},
                                                    count=count, block=block_ms)
        what = f"read from queue {self.stream!r}"
        try:
            reply = await self._retry.call(op, what=what)
        except QueueError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._group_ready = False  # the stream was deleted under us: recreate the group, read once more
            await self._ensure_group()
            reply = await self._retry.call(op, what=what)
        return list(reply[0][1]) if reply else []

    async def _decode(self, raw: list[_RawEntry], *, recovered: bool = False) -> list[QueueEntry]:
        good: list[QueueEntry] = []
        bad: list[tuple[str, str]] = []
        for entry_id, fields in raw:
            eid = _str(entry_id)
            if not fields:  # redis-py turns the nil of a deleted entry into None or {}
                bad.append((eid, _DELETED))
                continue
            payload = fields.get(b"t")
            if payload is None:
                bad.append((eid, f"no payload: no 't' field (fields were {sorted(map(_str, fields))})"))
                continue
            try:
                good.append(QueueEntry(eid, codec.from_msgpack(payload)))
            except SchemaError as exc:
                bad.append((eid, str(exc)))
                continue
            if b"i" in fields and b"v" in fields and len(self._delivered) < _MAX_REMEMBERED:
                self._delivered[eid] = (fields[b"i"], fields[b"v"])
        if bad:
            await self._move_to_dead_letters(bad)
        if recovered and good:
            log.info("consumer %s got back %d of its unacknowledged entries of %r",
                     self.consumer, len(good), self.stream)
        return good

    async def _move_to_dead_letters(self, bad: list[tuple[str, str]]) -> None:
        for eid, why in bad:
            log.error("queue %r: entry %s moved to %r: %s", self.stream, eid, self._dead, why)
        args: list[Any] = [self.group, self.consumer or "", self._dead_maxlen]
        for eid, why in bad:
            args.extend((eid, why))
        await self._call(lambda: self._dead_letter(keys=[*self._keys, self._dead], args=args), "dead-letter")

    async def _ensure_group(self) -> None:
        if self._group_ready:
            return

        async def create() -> None:
            try:
                await self._redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
            except redis.exceptions.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        await self._call(create, "create consumer group")
        self._group_ready = True

    def _require_consumer(self) -> str:
        if not self.consumer:
            raise ConfigError(f"reading queue {self.stream!r} needs a consumer name: pass consumer=... "
                              "(stable per trainer rank, e.g. 'trainer-0')")
        return self.consumer


def _as_pieces(t: Trajectory) -> Pieces:
    return Pieces(codec.wire_pieces(t))


def _oldest_version(t: Trajectory) -> int:
    """``t.min_version`` from the first model token: tokens are generated in order and the weight
    version a worker serves never decreases, so the first model token carries the oldest version."""
    model = t.loss_mask[t.prompt_len:]
    if not model.size:
        return -1
    first = int(model.argmax()) + t.prompt_len  # vectorised: the first model token
    return int(t.weight_versions[first]) if t.loss_mask[first] else -1


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
