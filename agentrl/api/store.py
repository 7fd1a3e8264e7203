"""Evaluation tasks and their results in Redis (key layout and atomic steps in :mod:`agentrl.api._scripts`).

Nothing about a task lives only in a process: the spec and its dataset, the status and progress, every sample
record. A worker claims a queued task with a lease it renews while it runs; a task whose lease expires (its
worker died) is queued again and resumed from its stored records by whichever worker claims it next.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio
import redis.exceptions

from agentrl.api import _scripts
from agentrl.api.base import TaskLost, TaskStatus
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
                   error=s.get("error") or None, worker=s.get("worker") or None)


class TaskStore:
    """The Redis side of the service. Redis failures raise :class:`agentrl.errors.QueueError`."""

    def __init__(self, client: redis.asyncio.Redis, namespace: str = "{agentrl-evals}", *,
                 timeout_s: float = 30.0) -> None:
        self.r = client
        self.ns = namespace
        self.timeout_s = timeout_s
        self._queue, self._leases, self._index = f"{namespace}:queue", f"{namespace}:leases", f"{namespace}:index"
        self._prefix = f"{namespace}:task:"
        self._scripts = {name: client.register_script(getattr(_scripts, name))
                         for name in ("CLAIM", "HEARTBEAT", "REAP", "RELEASE", "APPEND", "FINISH", "CANCEL")}

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

    async def submit(self, spec: dict[str, Any], items: list[dict[str, Any]], total: int) -> str:
        """Store a new queued task and its dataset; returns its id."""
        task_id = uuid.uuid4().hex
        now = time.time()
        fields: dict[Any, Any] = {"status": TaskStatus.QUEUED.value, "spec": json.dumps(spec), "total": total, "done": 0,
                  "errors": 0, "attempts": 0, "created_at": repr(now)}

        async def write() -> None:
            async with self.r.pipeline(transaction=True) as p:
                p.hset(self._key("task", task_id), mapping=fields)
                p.set(self._key("items", task_id), json.dumps(items))
                p.zadd(self._index, {task_id: now})
                p.rpush(self._queue, task_id)
                await p.execute()

        await self._do(write)
        return task_id

    async def get(self, task_id: str) -> TaskRecord | None:
        h = await self._do(lambda: self.r.hgetall(self._key("task", task_id)))
        return TaskRecord.parse(task_id, h) if h else None

    async def list_tasks(self, *, limit: int = 50, status: TaskStatus | None = None) -> list[TaskRecord]:
        """Newest first; with ``status``, among the newest ``10 * limit`` tasks."""
        scan = limit if status is None else 10 * limit
        raw: list[Any] = await self._do(lambda: self.r.zrevrange(self._index, 0, scan - 1))
        ids = [bytes(i).decode() for i in raw]

        async def fetch() -> list[Any]:
            async with self.r.pipeline(transaction=False) as p:
                for i in ids:
                    p.hgetall(self._key("task", i))
                return list(await p.execute())

        tasks = [TaskRecord.parse(i, h) for i, h in zip(ids, await self._do(fetch)) if h]
        return [t for t in tasks if status is None or t.status is status][:limit]

    async def results(self, task_id: str, offset: int, limit: int) -> tuple[int, list[str]]:
        """(number of records, the JSON records ``offset .. offset + limit - 1``)."""
        key = self._key("results", task_id)

        async def page() -> list[Any]:
            async with self.r.pipeline(transaction=False) as p:
                p.llen(key)
                p.lrange(key, offset, offset + limit - 1)
                return list(await p.execute())

        total, rows = await self._do(page)
        return int(total), [r.decode() for r in rows]

    async def cancel(self, task_id: str) -> TaskStatus | None:
        """Cancel a queued or running task; returns its status *before* (None: no such task)."""
        before = await self._script("CANCEL", [self._key("task", task_id), self._queue], [task_id, repr(time.time())])
        return TaskStatus(before.decode()) if before else None

    async def queue_length(self) -> int:
        return int(await self._do(lambda: self.r.llen(self._queue)))

    async def ping(self) -> bool:
        return bool(await self._do(self.r.ping))

    # ------------------------------------------------------------------------------------------- worker side

    async def claim(self, worker: str, *, lease_s: float, max_attempts: int) -> str | None:
        out = await self._script("CLAIM", [self._queue, self._leases],
                                 [self._prefix, worker, int(lease_s * 1000), max_attempts, repr(time.time())])
        return out.decode() if out else None

    async def heartbeat(self, task_id: str, worker: str, *, lease_s: float, metrics: dict[str, Any] | None = None) -> str:
        """Extend the lease; returns ``running``, another status (``cancelled``), or ``lost``."""
        out = await self._script("HEARTBEAT", [self._key("task", task_id), self._leases],
                                 [task_id, worker, int(lease_s * 1000), json.dumps(metrics) if metrics else ""])
        return str(out.decode())

    async def reap(self) -> int:
        """Re-queue running tasks whose lease expired; returns how many."""
        return int(await self._script("REAP", [self._queue, self._leases], [self._prefix]))

    async def release(self, task_id: str, worker: str) -> bool:
        return bool(await self._script("RELEASE", [self._key("task", task_id), self._queue, self._leases],
                                       [task_id, worker]))

    async def append(self, task_id: str, worker: str, key: str, record_json: str, ok: bool) -> bool:
        """Store one sample record; False if it was stored before. Raises TaskLost if not this worker's task."""
        keys = [self._key("task", task_id), self._key("results", task_id), self._key("done", task_id)]
        out = int(await self._script("APPEND", keys, [worker, key, record_json, "1" if ok else "0"]))
        if out < 0:
            raise TaskLost(f"task {task_id} is no longer run by {worker} (cancelled or taken over)")
        return out == 1

    async def finish(self, task_id: str, worker: str, status: TaskStatus, *, metrics: dict[str, Any] | None,
                     error: str | None = None) -> bool:
        return bool(await self._script(
            "FINISH", [self._key("task", task_id), self._leases],
            [task_id, worker, status.value, json.dumps(metrics) if metrics is not None else "", error or "",
             repr(time.time())]))

    async def load_items(self, task_id: str) -> list[dict[str, Any]]:
        raw = await self._do(lambda: self.r.get(self._key("items", task_id)))
        return list(json.loads(raw)) if raw else []

    async def load_records(self, task_id: str) -> list[dict[str, Any]]:
        rows = await self._do(lambda: self.r.lrange(self._key("results", task_id), 0, -1))
        return [json.loads(r) for r in rows]

    # ------------------------------------------------------------------------------------------------ events
    # ``N:events:<id>``: a stream of the task's events (``kind``, ``data`` JSON), trimmed to about ``maxlen``
    # entries; the entry id is the event id of ``GET /v1/evals/{id}/events`` (``Last-Event-ID`` resumes after it).

    async def add_event(self, task_id: str, kind: str, data: dict[str, Any], *, maxlen: int = 10_000) -> str:
        """Append an event to the task's stream; returns its id."""
        fields: dict[Any, Any] = {"kind": kind, "data": json.dumps(data, allow_nan=False)}
        out = await self._do(lambda: self.r.xadd(self._key("events", task_id), fields, maxlen=maxlen,
                                                  approximate=True))
        return out.decode() if isinstance(out, bytes) else str(out)

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
