"""Evaluation tasks and their results in Redis (key layout and atomic steps in :mod:`agentrl.api._scripts`).

Nothing about a task lives only in a process: the spec and its dataset, the status and progress, every sample
record. A worker claims a queued task with a lease it renews while it runs; a task whose lease expires (its
worker died) is queued again and resumed from its stored records by whichever worker claims it next.

Records are stored zlib-compressed (a trajectory's token ids, masks and logprobs as JSON shrink ~2-5x); the bytes
stored (datasets and compressed records) are counted per task and in total, and both counts are bounded.
Listing walks sorted-set indexes (per tenant: all, status, environment, label) by ``seq`` — the submission time
in microseconds of the Redis clock, strictly increasing — so a cursor is the last ``seq`` seen.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio
import redis.exceptions

from agentrl.api import _scripts
from agentrl.api.base import DEFAULT_TENANT, IdempotencyConflict, StoreFull, TaskLost, TaskStatus
from agentrl.errors import QueueError

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TaskRecord:
    """A task as stored (``spec`` and ``metrics`` parsed)."""

    id: str
    status: TaskStatus
    spec: dict[str, Any]
    total: int
    done: int
    errors: int
    attempts: int
    created_at: float
    started_at: float | None
    finished_at: float | None
    metrics: dict[str, Any] | None
    error: str | None
    worker: str | None
    tenant: str = DEFAULT_TENANT
    bytes: int = 0  # its stored (compressed) records
    seq: int = 0  # its place in the listing indexes (0: stored before they existed)

    @classmethod
    def parse(cls, task_id: str, h: Any) -> TaskRecord:
        s = {k.decode(): v.decode() for k, v in h.items()}

        def num(key: str) -> float | None:
            return float(s[key]) if s.get(key) else None

        return cls(id=task_id, status=TaskStatus(s["status"]), spec=json.loads(s.get("spec") or "{}"),
                   total=int(s.get("total", 0)), done=int(s.get("done", 0)), errors=int(s.get("errors", 0)),
                   attempts=int(s.get("attempts", 0)), created_at=float(s.get("created_at", 0)),
                   started_at=num("started_at"), finished_at=num("finished_at"),
                   metrics=json.loads(s["metrics"]) if s.get("metrics") else None,
                   error=s.get("error") or None, worker=s.get("worker") or None,
                   tenant=s.get("tenant") or DEFAULT_TENANT, bytes=int(s.get("bytes", 0)), seq=int(s.get("seq", 0)))


@dataclass(frozen=True, slots=True)
class ListQuery:
    """A listing: the tasks of ``tenant`` (None: every tenant's) matching every filter given, newest first."""

    tenant: str | None = None
    status: TaskStatus | None = None
    environment: str | None = None
    labels: tuple[tuple[str, str], ...] = ()
    created_after: float | None = None  # unix seconds, inclusive
    created_before: float | None = None  # exclusive
    after: int | None = None  # cursor: the seq of the last task of the previous page
    limit: int = 50


def label_index(key: str, value: str) -> str:
    """A label's index name: the key's length (UTF-8 bytes, as Lua counts) first, so ``a=b``/``c`` and
    ``a``/``b=c`` do not collide."""
    return f"{len(key.encode())}:{key}={value}"


def pack_record(record_json: str) -> bytes:
    return zlib.compress(record_json.encode(), 6)


def unpack_record(raw: bytes) -> str:
    """A stored record as JSON text (records stored before compression are plain JSON: they start with ``{``)."""
    return raw.decode() if raw[:1] == b"{" else zlib.decompress(raw).decode()


def body_hash(spec: dict[str, Any]) -> str:
    """What an Idempotency-Key is bound to: the validated spec, canonical JSON (key order does not matter)."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class TaskStore:
    """The Redis side of the service. Redis failures raise :class:`agentrl.errors.QueueError`."""

    def __init__(self, client: redis.asyncio.Redis, namespace: str = "{agentrl-evals}", *,
                 timeout_s: float = 30.0, max_task_bytes: int = 256 << 20, max_store_bytes: int = 1 << 30,
                 idempotency_ttl_s: float = 86_400.0) -> None:
        self.r = client
        self.ns = namespace
        self.timeout_s = timeout_s
        self.max_task_bytes, self.max_store_bytes = max_task_bytes, max_store_bytes
        self.idempotency_ttl_s = idempotency_ttl_s
        self._queue, self._leases, self._bytes = f"{namespace}:queue", f"{namespace}:leases", f"{namespace}:bytes"
        self._scripts = {name: client.register_script(getattr(_scripts, name))
                         for name in ("SUBMIT", "LIST", "CLAIM", "HEARTBEAT", "REAP", "RELEASE", "APPEND", "FINISH",
                                      "CANCEL", "PURGE", "EXPIRE", "MIGRATE", "EVENT")}

    def _key(self, kind: str, task_id: str) -> str:
        return f"{self.ns}:{kind}:{task_id}"

    async def _do(self, call: Callable[[], Awaitable[T]]) -> T:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await call()
        except (redis.exceptions.RedisError, OSError, TimeoutError) as exc:
            raise QueueError(f"Redis failed during a task-store operation: {type(exc).__name__}: {exc}") from exc

    async def _script(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return await self._do(lambda: self._scripts[name](keys=keys, args=args))

    # ---------------------------------------------------------------------------------------------- API side

    async def submit(self, spec: dict[str, Any], items: list[dict[str, Any]], total: int, *,
                     tenant: str = DEFAULT_TENANT, idempotency_key: str | None = None,
                     request: dict[str, Any] | None = None) -> tuple[str, bool]:
        """Store a new queued task and its dataset; returns (its id, True). With an ``idempotency_key`` seen
        before (for this tenant, within ``idempotency_ttl_s``) and the same ``request`` (the spec as submitted,
        before the server resolved it; default ``spec``): (that task's id, False), and nothing is stored. Raises :class:`IdempotencyConflict` for the same key with another spec, and
        :class:`StoreFull` when the store's bytes would pass ``max_store_bytes``. One script: two concurrent
        submissions with one key make one task."""
        task_id = uuid.uuid4().hex
        idem = "" if idempotency_key is None else self._idem_key(tenant, idempotency_key)
        env = str(spec.get("environment", {}).get("name", ""))
        labels = [label_index(k, v) for k, v in sorted(dict(spec.get("labels") or {}).items())]
        out = await self._script("SUBMIT", [], [
            self.ns, task_id, tenant, json.dumps(spec), json.dumps(items), total, idem,
            body_hash(spec if request is None else request),
            int(self.idempotency_ttl_s * 1000), self.max_store_bytes, env, json.dumps(labels)])
        kind, value = (bytes(x).decode() for x in out)
        if kind == "new":
            return value, True
        if kind == "same":
            return value, False
        if kind == "conflict":
            raise IdempotencyConflict(f"this Idempotency-Key was used for task {value} with another request body; "
                                      "use a new key for a new evaluation", value)
        raise StoreFull(f"the evaluation store holds {int(value)} bytes and its bound (max_store_bytes) is "
                        f"{self.max_store_bytes}: purge finished tasks (DELETE /v1/evals/ID?purge=true) or ask "
                        "the operator to raise the bound")

    def _idem_key(self, tenant: str, idempotency_key: str) -> str:
        return f"{self.ns}:idem:{tenant}:{hashlib.sha256(idempotency_key.encode()).hexdigest()}"

    async def replay(self, spec: dict[str, Any], *, tenant: str, idempotency_key: str) -> str | None:
        """The task this tenant's ``idempotency_key`` made with ``spec`` (None: the key is not known, or its
        task was purged); :class:`IdempotencyConflict` when it was used with another spec. A read-only look
        before the work of a submission (:meth:`submit` decides atomically)."""
        key = self._idem_key(tenant, idempotency_key)

        async def look() -> tuple[str, int]:
            raw = await self.r.get(key)
            value = raw.decode() if isinstance(raw, bytes) else str(raw or "")
            task_id = value.partition(" ")[2]
            return value, int(await self.r.exists(self._key("task", task_id))) if task_id else 0

        value, exists = await self._do(look)
        if not exists:
            return None
        digest, _, task_id = value.partition(" ")
        if digest != body_hash(spec):
            raise IdempotencyConflict(f"this Idempotency-Key was used for task {task_id} with another request "
                                      "body; use a new key for a new evaluation", task_id)
        return str(task_id)

    async def get(self, task_id: str) -> TaskRecord | None:
        h = await self._do(lambda: self.r.hgetall(self._key("task", task_id)))
        return TaskRecord.parse(task_id, h) if h else None

    async def list_page(self, q: ListQuery) -> tuple[list[TaskRecord], int | None]:
        """One page of ``q``: the tasks, and the cursor of the next page (None: this page is the last)."""
        scope = "*" if q.tenant is None else q.tenant
        keys = []
        if q.status is not None:
            keys.append(f"status:{q.status.value}")
        if q.environment is not None:
            keys.append(f"env:{q.environment}")
        keys += [f"label:{label_index(k, v)}" for k, v in q.labels]
        keys = [f"{self.ns}:ix:{scope}:{k}" for k in keys or ["all"]]
        hi = [] if q.after is None else [q.after]
        if q.created_before is not None:
            hi.append(round(q.created_before * 1_000_000))
        lo = "-inf" if q.created_after is None else str(round(q.created_after * 1_000_000))
        raw = await self._script("LIST", keys, [f"({min(hi)}" if hi else "+inf", lo, q.limit])
        flat = [bytes(x).decode() for x in raw]
        ids, seqs = flat[0::2], [int(float(x)) for x in flat[1::2]]
        more = len(ids) > q.limit
        ids, seqs = ids[: q.limit], seqs[: q.limit]

        async def fetch() -> list[Any]:
            async with self.r.pipeline(transaction=False) as p:
                for i in ids:
                    p.hgetall(self._key("task", i))
                return list(await p.execute())

        tasks = [TaskRecord.parse(i, h) for i, h in zip(ids, await self._do(fetch)) if h]
        return tasks, (seqs[-1] if more and seqs else None)

    async def results(self, task_id: str, offset: int, limit: int) -> tuple[int, list[str]]:
        """(number of records, the JSON records ``offset .. offset + limit - 1``)."""
        key = self._key("results", task_id)

        async def page() -> list[Any]:
            async with self.r.pipeline(transaction=False) as p:
                p.llen(key)
                p.lrange(key, offset, offset + limit - 1)
                return list(await p.execute())

        total, rows = await self._do(page)
        return int(total), [unpack_record(r) for r in rows]

    async def cancel(self, task_id: str) -> TaskStatus | None:
        """Cancel a queued or running task; returns its status *before* (None: no such task)."""
        before = await self._script("CANCEL", [self._key("task", task_id), self._queue],
                                    [task_id, repr(time.time()), self.ns])
        return TaskStatus(before.decode()) if before else None

    async def purge(self, task_id: str) -> int | None:
        """Delete a task, its dataset, records and index entries; returns the bytes freed (None: no such task).
        A worker running it loses its fence and stops."""
        freed = int(await self._script("PURGE", [], [self.ns, task_id]))
        return None if freed < 0 else freed

    async def expire(self, ttl_s: float, *, batch: int = 100) -> int:
        """Purge up to ``batch`` tasks that finished more than ``ttl_s`` ago; returns how many."""
        return int(await self._script("EXPIRE", [], [self.ns, int(ttl_s * 1000), batch]))

    async def counts(self) -> dict[str, int]:
        """Stored tasks per status, all tenants (from the status indexes)."""
        async def card() -> list[Any]:
            async with self.r.pipeline(transaction=False) as p:
                for st in TaskStatus:
                    p.zcard(f"{self.ns}:ix:*:status:{st.value}")
                return list(await p.execute())

        return {st.value: int(n) for st, n in zip(TaskStatus, await self._do(card))}

    async def migrate(self, *, batch: int = 50) -> int:
        """Index the tasks stored before tenants, cursors and byte bounds existed (as the tenant ``default``);
        a batch per script, so Redis is never blocked long. Returns how many; idempotent."""
        total = 0
        while n := int(await self._script("MIGRATE", [], [self.ns, DEFAULT_TENANT, batch])):
            total += n
        return total

    async def stored_bytes(self) -> int:
        """Bytes of datasets and (compressed) records stored for all tasks (what ``max_store_bytes`` bounds)."""
        return int(await self._do(lambda: self.r.get(self._bytes)) or 0)

    async def queue_length(self) -> int:
        return int(await self._do(lambda: self.r.llen(self._queue)))

    async def ping(self) -> bool:
        return bool(await self._do(self.r.ping))

    # ------------------------------------------------------------------------------------------- worker side

    async def claim(self, worker: str, *, lease_s: float, max_attempts: int) -> str | None:
        out = await self._script("CLAIM", [self._queue, self._leases],
                                 [self.ns, worker, int(lease_s * 1000), max_attempts, repr(time.time())])
        return out.decode() if out else None

    async def heartbeat(self, task_id: str, worker: str, *, lease_s: float, metrics: dict[str, Any] | None = None) -> str:
        """Extend the lease; returns ``running``, another status (``cancelled``), or ``lost``."""
        out = await self._script("HEARTBEAT", [self._key("task", task_id), self._leases],
                                 [task_id, worker, int(lease_s * 1000), json.dumps(metrics) if metrics else ""])
        return str(out.decode())

    async def reap(self) -> int:
        """Re-queue running tasks whose lease expired; returns how many."""
        return int(await self._script("REAP", [self._queue, self._leases], [self.ns]))

    async def release(self, task_id: str, worker: str) -> bool:
        return bool(await self._script("RELEASE", [self._key("task", task_id), self._queue, self._leases],
                                       [task_id, worker, self.ns]))

    async def append(self, task_id: str, worker: str, key: str, record_json: str, ok: bool) -> bool:
        """Store one sample record (compressed); False if it was stored before. Raises TaskLost if not this
        worker's task, StoreFull when the task's records or the store would pass their bound."""
        keys = [self._key("task", task_id), self._key("results", task_id), self._key("done", task_id), self._bytes]
        out = int(await self._script("APPEND", keys, [worker, key, pack_record(record_json), "1" if ok else "0",
                                                      self.max_task_bytes, self.max_store_bytes]))
        if out == -1:
            raise TaskLost(f"task {task_id} is no longer run by {worker} (cancelled, purged or taken over)")
        if out == -2:
            raise StoreFull(f"the task's stored records reached max_task_result_bytes ({self.max_task_bytes} bytes, "
                            "compressed): evaluate fewer items per task, or without keep_trajectories")
        if out == -3:
            raise StoreFull(f"the evaluation store reached its bound (max_store_bytes, {self.max_store_bytes} bytes): "
                            "purge finished tasks (DELETE /v1/evals/ID?purge=true) and submit again")
        return out == 1

    async def finish(self, task_id: str, worker: str, status: TaskStatus, *, metrics: dict[str, Any] | None,
                     error: str | None = None) -> bool:
        return bool(await self._script(
            "FINISH", [self._key("task", task_id), self._leases],
            [task_id, worker, status.value, json.dumps(metrics) if metrics is not None else "", error or "",
             repr(time.time()), self.ns]))

    async def load_items(self, task_id: str) -> list[dict[str, Any]]:
        raw = await self._do(lambda: self.r.get(self._key("items", task_id)))
        return list(json.loads(raw)) if raw else []

    async def load_records(self, task_id: str) -> list[dict[str, Any]]:
        rows = await self._do(lambda: self.r.lrange(self._key("results", task_id), 0, -1))
        return [json.loads(unpack_record(r if isinstance(r, bytes) else r.encode())) for r in rows]

    # ------------------------------------------------------------------------------------------------ events
    # ``N:events:<id>``: a stream of the task's events (``kind``, ``data`` JSON), trimmed to about ``maxlen``
    # entries; the entry id is the event id of ``GET /v1/evals/{id}/events`` (``Last-Event-ID`` resumes after it).

    async def add_event(self, task_id: str, kind: str, data: dict[str, Any], *, maxlen: int = 10_000) -> str | None:
        """Append an event to the task's stream; returns its id (None: the task is gone, e.g. purged)."""
        out = await self._script("EVENT", [self._key("task", task_id), self._key("events", task_id)],
                                 [maxlen, kind, json.dumps(data, allow_nan=False)])
        return None if not out else out.decode() if isinstance(out, bytes) else str(out)

    async def read_events(self, task_id: str, after: str, *, block_ms: int | None,
                          count: int = 200) -> list[tuple[str, str, str]]:
        """Events after id ``after`` (``"0"``: from the first kept), as ``(id, kind, data JSON)``; waits up to
        ``block_ms`` for one (None: does not wait)."""
        key = self._key("events", task_id)
        out: Any = await self._do(lambda: self.r.xread({key: after}, count=count, block=block_ms))
        if not out:
            return []
        entries = out[0][1] if isinstance(out, list) else next(iter(out.values()))[0]
        return [(eid.decode(), f[b"kind"].decode(), f[b"data"].decode()) for eid, f in entries]
