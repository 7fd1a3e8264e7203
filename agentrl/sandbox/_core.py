"""The warm-pool sandbox core shared by the local (bubblewrap) and Docker backends.

A backend says only how one *worker* (an isolated launcher process, ``runtime/launcher.py``, ready for a
request) is started (``_spawn``), prepared for a run's limits (``_prepare``), and what it needs once before the
first start (``_setup``) or after the last stop (``_teardown``); the worker stops itself (``destroy``). Everything
else is here, once:

- ``run``: at most ``max_concurrency`` runs at a time; a warm worker from the pool of the run's container-level
  limits (``_pool_key``), replaced once by a fresh one if it died while idle; the worker is reused after a clean
  run and destroyed after a dirty, timed-out or ``max_uses``-th one;
- starts: at most ``max_starting`` workers start at once, however many the pools, the runs and the sessions ask
  for (a burst of runs on a cold pool must not ask the Docker engine for dozens of containers at once);
- ``session``: at most ``max_sessions`` open (a new one waits ``session_wait_s`` for a slot), each on a worker
  of its own that is never reused;
- failures to start: the sandbox's own failure, never the program's. ``run`` answers them with a
  ``SandboxError`` *result* (``start()`` failing included: the caller is never crashed and never scores it, as
  the SandboxFusion-compatible server's ``/run_code`` answers ``SandboxError``); ``session`` and ``start`` raise
  :class:`agentrl.errors.SandboxError` (they have no result to carry it). A start that failed is tried again by
  the next call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import Any, Generic, Protocol, Self, TypeVar

from agentrl.errors import ConfigError, SandboxError
from agentrl.sandbox._pool import WarmPool
from agentrl.sandbox._session import Box, ReplSession
from agentrl.sandbox._wire import (
    Collected,
    ProtocolError,
    check_request,
    collect,
    compile_limits,
    repl_message,
    run_message,
    run_result,
    sandbox_error,
    start_repl,
)
from agentrl.sandbox.base import Limits, RunRequest, RunResult
from agentrl.sandbox.languages import LANGUAGE_TABLE

log = logging.getLogger(__name__)

WIPE = ("/tmp", "/dev/shm", "/dev/mqueue")  # everything writable in a worker, emptied after each run
MAX_POOLS = 8  # distinct container-level limits kept warm; past that, workers are made per run
START_ERRORS = (TimeoutError, asyncio.IncompleteReadError, ProtocolError, OSError, ConnectionError, ValueError)


class Worker(Box, Protocol):
    """One started worker: the launcher's stream (``conn``), how many runs it served, whether it lives."""

    uses: int

    def alive(self) -> bool: ...


W = TypeVar("W", bound=Worker)


class WarmSandbox(ABC, Generic[W]):
    """The Sandbox protocol over warm workers (see the module docstring). ``limits`` are the container-level
    limits of the main pool (the default of ``session``); ``kind`` names the backend in messages."""

    kind = "warm"

    def __init__(self, *, limits: Limits, max_concurrency: int, pool_size: int | None, max_sessions: int,
                 session_idle_s: float, session_wait_s: float, start_timeout_s: float, grace_s: float,
                 max_uses: int, max_starting: int = 4) -> None:
        if max_concurrency < 1 or max_sessions < 1 or max_starting < 1:
            raise ConfigError(f"max_concurrency, max_sessions and max_starting must be >= 1, got {max_concurrency}, "
                              f"{max_sessions} and {max_starting}")
        self.limits, self.max_sessions = limits, max_sessions
        self._start_timeout_s, self._grace_s, self._max_uses = start_timeout_s, grace_s, max_uses
        self._idle_s, self._session_wait_s = session_idle_s, session_wait_s
        self._runs = asyncio.Semaphore(max_concurrency)
        self._starting = asyncio.Semaphore(max_starting)  # workers starting at once (see _start_worker)
        self._session_slots = asyncio.Semaphore(max_sessions)
        self._sessions: set[ReplSession] = set()
        self._pool_size = pool_size or max_concurrency
        self._pools: dict[Hashable, WarmPool[W]] = {}
        self._started = asyncio.Lock()
        self._ready = self._closed = False

    # ------------------------------------------------------------------------------ what a backend says

    @abstractmethod
    async def _setup(self) -> None:
        """Once, before the first worker: find and check what workers need (raises SandboxError)."""

    @abstractmethod
    async def _spawn(self, limits: Limits) -> W:
        """Start one worker with these container-level limits, answering a ping (raises SandboxError)."""

    async def _start_worker(self, limits: Limits) -> W:
        """``_spawn``, at most ``max_starting`` at a time: every start goes through here."""
        async with self._starting:
            return await self._spawn(limits)

    def _pool_key(self, limits: Limits) -> Hashable:
        """The part of ``limits`` fixed when a worker starts (workers differing in it are pooled apart)."""
        return None

    async def _prepare(self, worker: W, limits: Limits) -> None:
        """Apply a run's (or its compile step's) limits to a started worker, just before it runs (e.g. its
        cgroup's memory); raises OSError if they cannot be applied (e.g. lower than what it already uses)."""

    def _launch_options(self) -> dict[str, Any]:
        """``cgroup_memory`` (a memory cgroup bounds the worker) and ``nproc`` for the launcher's rlimits."""
        return {"cgroup_memory": True}

    async def _teardown(self) -> None:
        """After every pool and session is closed."""

    # ------------------------------------------------------------------------------------------ set-up

    async def start(self) -> Self:
        """Set up, start one worker to prove it works, fill the main pool (raises SandboxError)."""
        async with self._started:
            if self._ready:
                return self
            if self._closed:
                raise SandboxError(f"the {self.kind} sandbox is closed")
            await self._setup()
            pool = self._pool(self.limits)
            pool.put(await self._start_worker(self.limits))
            pool.fill()
            self._ready = True
            log.info("%s sandbox ready", self.kind)
        return self

    def _pool(self, limits: Limits) -> WarmPool[W]:
        """The warm pool for these container-level limits (the main limits' pool is full size; a pool for
        other limits is made on first use, with room for two)."""
        key = self._pool_key(limits)
        pool = self._pools.get(key)
        if pool is None:
            size = self._pool_size if key == self._pool_key(self.limits) else min(2, self._pool_size)
            if len(self._pools) >= MAX_POOLS:
                size = 0  # too many distinct limits: workers for these are made per run, not kept warm
            lim = Limits(memory_mb=limits.memory_mb, pids=limits.pids, file_size_mb=limits.file_size_mb)
            pool = self._pools[key] = WarmPool(lambda: self._start_worker(lim), _destroy, size, alive=_alive,
                                               name=f"{self.kind} sandbox")
        return pool

    # ------------------------------------------------------------------------------------------- runs

    async def run(self, request: RunRequest) -> RunResult:
        check_request(request)
        t0 = time.monotonic()
        try:
            await self.start()
        except SandboxError as exc:
            return sandbox_error(str(exc), time.monotonic() - t0)
        pool = self._pool(request.limits)
        async with self._runs:
            for attempt in range(2):  # a warm worker that died while idle is replaced once
                try:
                    worker = await (pool.get() if attempt == 0 else self._start_worker(request.limits))
                except SandboxError as exc:
                    return sandbox_error(str(exc), time.monotonic() - t0)
                result = await self._run_in(worker, request, t0, pool)
                if result is not None:
                    return result
            return sandbox_error("the sandbox failed twice before the program started", time.monotonic() - t0)

    async def _run_in(self, worker: W, request: RunRequest, t0: float, pool: WarmPool[W]) -> RunResult | None:
        """The run's result, or None if the worker failed before the program started (then it is discarded).
        A compiled language compiles first under ``compile_limits`` (the worker's cgroup too), then the run's
        limits are set before the program starts."""
        limits, got, host_timeout, keep = request.limits, Collected(), False, False
        lang = LANGUAGE_TABLE[request.language]
        message = run_message(request, **self._launch_options(), wipe=WIPE, check_clean=True, keep=True)
        budget = request.run_time_s + (limits.compile_time_s if lang.compiled else 0.0) + self._grace_s

        async def compiled() -> bool:
            try:
                await self._prepare(worker, limits)
            except OSError as exc:  # e.g. the build's files take more memory than the run may use
                log.info("the run's limits could not be set after the compile step: %r", exc)
                return False
            return True

        try:
            try:
                async with asyncio.timeout(budget):
                    await self._prepare(worker, compile_limits(limits) if lang.compiled else limits)
                    oom_before = worker.oom_kills()
                    await worker.conn.send(message)
                    await collect(worker.conn, limits.output_bytes, got, compiled)
            except TimeoutError:
                host_timeout = True
            except (OSError, ConnectionError) as exc:
                got.error = repr(exc)
            r = got.result or {}
            if not got.started and r.get("missing"):
                keep = True  # nothing ran
                return sandbox_error(lang.missing_hint(str(r["missing"]), self.kind), time.monotonic() - t0)
            if not got.started:
                log.warning("a warm %s sandbox failed before the run started: %s", self.kind,
                            got.error or "no answer")
                return None
            worker.uses += 1
            timed_out = host_timeout or r.get("timed_out") or any(c.get("timed_out") for c in r.get("cases") or ())
            keep = bool(r.get("clean")) and not timed_out and worker.uses < self._max_uses
            return run_result(got, request, host_timeout=host_timeout, oom=worker.oom_kills() > oom_before,
                              wall_s=time.monotonic() - t0)
        finally:
            if keep:
                pool.put(worker)
            else:
                pool.discard(worker)

    # ------------------------------------------------------------------------------------------- sessions

    async def session(self, language: str = "python", limits: Limits | None = None) -> ReplSession:
        """A persistent Python interpreter on a worker of its own (raises SandboxError if none can be had)."""
        if language != "python":
            raise ConfigError(f"sessions run python only, got language={language!r}")
        await self.start()
        try:
            async with asyncio.timeout(self._session_wait_s):
                await self._session_slots.acquire()
        except TimeoutError:
            raise SandboxError(f"all {self.max_sessions} sandbox sessions stayed in use for "
                               f"{self._session_wait_s:g}s: close finished sessions or raise max_sessions") from None
        sess = ReplSession(self._start_repl, limits or self.limits, idle_s=self._idle_s, grace_s=self._grace_s,
                           on_close=self._session_closed)
        self._sessions.add(sess)
        try:
            await sess.start()
        except BaseException:
            await sess.aclose()
            raise
        return sess

    async def _start_repl(self, limits: Limits) -> W:
        worker = await self._pool(limits).get()
        try:
            await self._prepare(worker, limits)
            async with asyncio.timeout(self._start_timeout_s):
                await start_repl(worker.conn, repl_message(limits, **self._launch_options()))
        except START_ERRORS as exc:
            await worker.destroy()
            raise SandboxError(f"the session's interpreter did not start: {exc!r}") from None
        return worker

    def _session_closed(self, sess: ReplSession) -> None:
        if sess in self._sessions:
            self._sessions.discard(sess)
            self._session_slots.release()

    # ------------------------------------------------------------------------------------------- teardown

    async def aclose(self) -> None:
        self._closed = True
        for sess in list(self._sessions):
            await sess.aclose(why="the sandbox was closed")
        for pool in list(self._pools.values()):
            await pool.aclose()
        await self._teardown()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _alive(worker: Worker) -> bool:
    return worker.alive()


async def _destroy(worker: Worker) -> None:
    await worker.destroy()
