"""Workers of the evaluation service: claim queued tasks, run them, store every record as it finishes.

    slot 1..max_tasks:  claim ─► load spec, dataset, stored records ─► run_eval (skips stored samples)
                          │           │ every record ─► Redis (fenced: only the lease holder may write)
                          │           └ heartbeat every min(lease_s/3, 5 s): renew the lease, store metrics,
                          │             stop if the task was cancelled or taken over
                          └─► finish (succeeded | failed | cancelled) ─► claim the next one
    reaper:             every lease_s/2, re-queue running tasks whose lease expired (their worker died)
    retention:          with finished_ttl_s, every ttl/4 (0.1 .. 60 s), purge tasks finished more than ttl ago
                        (the store's purge script, so indexes and byte counts stay exact; plain Redis EXPIRE on
                        the task's keys would leave them behind) — in every process, even one with max_tasks 0

Events (``GET /v1/evals/{id}/events``) are written where the state changes: ``status`` (queued at submission,
running at each claim, cancelled by the API, the final status), ``progress`` (each stored record),
``metrics`` (partial, at a heartbeat that has new records) and ``end`` (the final state, as ``GET /v1/evals/{id}``
shows it; then the task's webhook, if its spec has one, is sent in the background). An event Redis could not take
is logged and skipped: the task's own state in Redis is what counts.

On shutdown the running tasks are handed back to the queue (not counted as an attempt); a worker that dies
without shutting down loses its leases, so its tasks are re-queued by any live worker's reaper and resumed.
Global limits are the services' own: episodes at once (``EvalServices.limiter``), generate calls per server
(``ModelServers``), programs in the sandbox (the sandbox's ``max_concurrency``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any

from agentrl.api.base import ApiSettings, StoreFull, TaskLost, TaskStatus
from agentrl.api.schemas import EvalState
from agentrl.api.store import TaskStore
from agentrl.api.webhooks import WebhookSender
from agentrl.errors import AgentRLError, ConfigError, InfrastructureError
from agentrl.eval.base import SampleRecord
from agentrl.eval.datasets import tasks_from_json
from agentrl.eval.metrics import compute_metrics, item_groups
from agentrl.eval.services import EvalServices
from agentrl.eval.spec import EvalSpec

logger = logging.getLogger(__name__)


@dataclass
class _Progress:
    """Records of the running task without their trajectories (for partial metrics)."""

    pass_k: list[int]
    records: list[SampleRecord] = field(default_factory=list)
    dirty: bool = False
    total: int = 0
    groups: dict[int, str] | None = None

    def add(self, record: SampleRecord) -> None:
        self.records.append(record.without_trajectory())
        self.dirty = True

    def metrics(self) -> dict[str, object]:
        self.dirty = False
        return compute_metrics(self.records, self.pass_k, self.groups)

    async def metrics_off_loop(self) -> dict[str, object]:
        """:meth:`metrics` in a thread (bootstrap intervals over many items take a while) on a snapshot."""
        self.dirty = False
        return await asyncio.to_thread(compute_metrics, list(self.records), self.pass_k, self.groups)

    def counts(self) -> dict[str, Any]:
        done = len(self.records)
        errors = sum(1 for r in self.records if not r.ok)
        return {"done": done, "total": self.total, "errors": errors,
                "fraction": round(done / self.total, 4) if self.total else 0.0}


class EvalWorkers:
    """``max_tasks`` task slots and a reaper in this event loop (see the module docstring)."""

    def __init__(self, store: TaskStore, services: EvalServices, settings: ApiSettings) -> None:
        self.store = store
        self.services = services
        self.settings = settings
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._wake = asyncio.Event()
        self._loops: list[asyncio.Task[None]] = []
        self.running: dict[str, asyncio.Task[None]] = {}
        self._cancels: dict[str, asyncio.Event] = {}
        self.webhooks = WebhookSender(settings)

    async def start(self) -> EvalWorkers:
        loop = asyncio.get_running_loop()
        self._loops = [loop.create_task(self._slot(i), name=f"eval-slot-{i}") for i in range(self.settings.max_tasks)]
        if self.settings.max_tasks:
            self._loops.append(loop.create_task(self._reaper(), name="eval-reaper"))
        if self.settings.finished_ttl_s is not None:
            self._loops.append(loop.create_task(self._retention(self.settings.finished_ttl_s), name="eval-retention"))
        logger.info("eval workers %s: %d task slots", self.worker_id, self.settings.max_tasks)
        return self

    def wake(self) -> None:
        """A task was queued: idle slots look now instead of at their next poll."""
        self._wake.set()

    def cancelled(self, task_id: str) -> None:
        """A task was cancelled: if this process runs it, stop it now (others see it at their next heartbeat)."""
        event = self._cancels.get(task_id)
        if event is not None:
            event.set()

    async def aclose(self) -> None:
        """Stop; running tasks go back to the queue (resumed later from their stored records)."""
        for t in self._loops:
            t.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        self._loops = []
        await self.webhooks.aclose()

    async def emit(self, task_id: str, kind: str, data: dict[str, Any]) -> None:
        """Append an event to the task's stream; a Redis failure is logged, not raised (module docstring)."""
        try:
            await self.store.add_event(task_id, kind, data, maxlen=self.settings.events_maxlen)
        except (AgentRLError, ValueError) as exc:  # ValueError: not JSON (a NaN would be a bug upstream)
            logger.warning("eval task %s: event %s not stored: %s", task_id, kind, exc)

    async def announce_cancel(self, task_id: str, before: TaskStatus) -> None:
        """The API cancelled a task that was ``before``: say so; a queued task ends here (no worker will)."""
        if before is TaskStatus.RUNNING:
            await self.emit(task_id, "status", {"status": TaskStatus.CANCELLED.value})  # its worker sends the end
        elif before is TaskStatus.QUEUED:
            await self._ended(task_id)

    async def _ended(self, task_id: str) -> None:
        """The task reached its final state: the ``status`` and ``end`` events, then its webhook."""
        try:
            rec = await self.store.get(task_id)
        except AgentRLError as exc:
            logger.warning("eval task %s: final events not stored: %s", task_id, exc)
            return
        if rec is None:
            return
        state = EvalState.of(rec, with_spec=False).model_dump(mode="json")
        await self.emit(task_id, "status", {"status": rec.status.value})
        await self.emit(task_id, "end", state)
        url = rec.spec.get("webhook_url")
        if isinstance(url, str) and url:
            self.webhooks.schedule(url, state)

    async def _slot(self, index: int) -> None:
        while True:
            try:
                task_id = await self.store.claim(self.worker_id, lease_s=self.settings.lease_s,
                                                 max_attempts=self.settings.max_attempts)
            except InfrastructureError as exc:
                logger.warning("eval slot %d cannot claim tasks: %s", index, exc)
                await asyncio.sleep(max(1.0, self.settings.poll_s))
                continue
            if task_id is None:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.settings.poll_s):
                        await self._wake.wait()
                continue
            run = asyncio.get_running_loop().create_task(self._run(task_id), name=f"eval-{task_id}")
            self.running[task_id] = run
            try:
                await asyncio.shield(run)
            except asyncio.CancelledError:
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
                raise
            except Exception:  # a bug: log it and keep the slot serving (the task's lease expires)
                logger.exception("eval slot %d: task %s crashed", index, task_id)
            finally:
                self.running.pop(task_id, None)

    async def _reaper(self) -> None:
        period = max(0.2, self.settings.lease_s / 2)
        while True:
            try:
                if await self.store.reap():
                    self.wake()
            except InfrastructureError as exc:
                logger.warning("eval reaper: %s", exc)
            await asyncio.sleep(period)

    async def _retention(self, ttl_s: float) -> None:
        period = min(60.0, max(0.1, ttl_s / 4))
        while True:
            try:
                while (n := await self.store.expire(ttl_s)) > 0:
                    logger.info("eval retention: purged %d tasks finished more than %.0f s ago", n, ttl_s)
            except InfrastructureError as exc:
                logger.warning("eval retention: %s", exc)
            await asyncio.sleep(period)

    async def _run(self, task_id: str) -> None:
        try:
            rec = await self.store.get(task_id)
            if rec is None:
                return
            spec = EvalSpec.model_validate(rec.spec)
            tasks = tasks_from_json(await self.store.load_items(task_id))
            done = [SampleRecord.from_dict(d).without_trajectory() for d in await self.store.load_records(task_id)]
        except asyncio.CancelledError:
            await self._release(task_id)
            raise
        except Exception as exc:  # a stored task that cannot be read is failed, not retried forever
            logger.exception("eval task %s cannot be loaded", task_id)
            await self._finish(task_id, TaskStatus.FAILED, None, f"the stored task cannot be loaded: {exc!r}")
            return
        logger.info("eval task %s: running (%d of %d samples already stored)", task_id, len(done), rec.total)
        progress = _Progress(pass_k=spec.pass_k, records=list(done), total=rec.total,
                             groups=item_groups(tasks, spec.group_by))
        await self.emit(task_id, "status", {"status": TaskStatus.RUNNING.value, "attempts": rec.attempts})
        cancel = self._cancels[task_id] = asyncio.Event()
        beat = asyncio.get_running_loop().create_task(self._heartbeat(task_id, cancel, progress))

        async def on_record(record: SampleRecord) -> None:
            body = json.dumps(record.to_dict(), allow_nan=False)
            stored = await self.store.append(task_id, self.worker_id, record.key, body, record.ok)
            progress.add(record)
            if stored:
                await self.emit(task_id, "progress", progress.counts())

        try:
            result = await self.services.evaluate(spec, tasks=tasks, completed=done, on_record=on_record,
                                                  cancel=cancel, keep_records=False, id_prefix=f"{task_id[:12]}-")
        except asyncio.CancelledError:
            await self._release(task_id)
            raise
        except TaskLost:  # cancelled (keep the partial metrics) or taken over or purged (then this is a no-op)
            await self._finish(task_id, TaskStatus.CANCELLED, progress.metrics(), None)
        except StoreFull as exc:  # its records (or the store) reached their bound: what is stored stays readable
            await self._finish(task_id, TaskStatus.FAILED, progress.metrics(), str(exc))
        except ConfigError as exc:
            await self._finish(task_id, TaskStatus.FAILED, progress.metrics(), f"invalid task: {exc}")
        except InfrastructureError as exc:
            await self._finish(task_id, TaskStatus.FAILED, progress.metrics(), f"{type(exc).__name__}: {exc}")
        except Exception as exc:
            logger.exception("eval task %s failed with an internal error", task_id)
            await self._finish(task_id, TaskStatus.FAILED, progress.metrics(), f"internal error: {exc!r}")
        else:
            status = TaskStatus.SUCCEEDED if result.status == "succeeded" else TaskStatus.CANCELLED
            await self._finish(task_id, status, result.metrics, None)
            logger.info("eval task %s: %s", task_id, status.value)
        finally:
            self._cancels.pop(task_id, None)
            beat.cancel()
            await asyncio.gather(beat, return_exceptions=True)

    async def _heartbeat(self, task_id: str, cancel: asyncio.Event, progress: _Progress) -> None:
        period = max(0.1, min(5.0, self.settings.lease_s / 3))
        while True:
            await asyncio.sleep(period)
            try:
                metrics = await progress.metrics_off_loop() if progress.dirty else None
                status = await self.store.heartbeat(task_id, self.worker_id, lease_s=self.settings.lease_s,
                                                    metrics=metrics)
                if metrics is not None and status == TaskStatus.RUNNING.value:
                    await self.emit(task_id, "metrics", metrics)
            except InfrastructureError as exc:  # Redis away for a moment: the lease has 3 beats of slack
                logger.warning("eval task %s heartbeat failed: %s", task_id, exc)
                continue
            if status != TaskStatus.RUNNING.value:
                logger.info("eval task %s is now %s: stopping it here", task_id, status)
                cancel.set()
                return

    async def _finish(self, task_id: str, status: TaskStatus, metrics: dict[str, object] | None,
                      error: str | None) -> None:
        try:
            finished = await self.store.finish(task_id, self.worker_id, status, metrics=metrics, error=error)
        except AgentRLError as exc:  # the lease runs out and the task is resumed elsewhere: nothing is lost
            logger.error("eval task %s could not be finished (%s); it will be resumed", task_id, exc)
            return
        if finished:
            await self._ended(task_id)

    async def _release(self, task_id: str) -> None:
        try:
            await asyncio.shield(self.store.release(task_id, self.worker_id))
        except (AgentRLError, asyncio.CancelledError) as exc:
            logger.warning("eval task %s was not handed back (%r); its lease will expire", task_id, exc)
