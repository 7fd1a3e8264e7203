"""A stateful Python session over the launcher's repl mode, shared by the local and Docker backends.

One interpreter per session, one cell at a time. A cell past its time limit kills the interpreter (reported as
``TimeLimitExceeded``); an interpreter that dies (``os._exit``, out of memory, a segfault) is the program's
``Error``. Either way the next cell gets a fresh interpreter: state is lost, as after a Jupyter kernel restart.
A session unused for ``idle_s`` seconds is closed; its later runs report a ``SandboxError`` saying so.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, Self

from agentrl.errors import SandboxError
from agentrl.sandbox._wire import Collected, Conn, collect, run_result, sandbox_error, text
from agentrl.sandbox.base import Limits, RequestStatus, RunRequest, RunResult, RunStatus


class Box(Protocol):
    """One launcher process (in whatever isolation) that the session talks to."""

    conn: Conn

    def oom_kills(self) -> int: ...  # how many of its processes the kernel killed for memory so far

    async def destroy(self) -> None: ...


class ReplSession:
    def __init__(self, start: Callable[[Limits], Awaitable[Box]], limits: Limits, *, idle_s: float,
                 grace_s: float, on_close: Callable[[ReplSession], None]) -> None:
        self._start, self.limits = start, limits
        self._idle_s, self._grace_s, self._on_close = idle_s, grace_s, on_close
        self._box: Box | None = None
        self._lock = asyncio.Lock()
        self._idle: asyncio.TimerHandle | None = None
        self._closed_why = ""
        self._expiring: asyncio.Task[None] | None = None  # referenced, so it is not collected mid-flight
        self.cells = 0

    @property
    def closed(self) -> bool:
        return bool(self._closed_why)

    async def start(self) -> None:
        """Start the interpreter now (raises SandboxError if it cannot)."""
        async with self._lock:
            self._box = await self._start(self.limits)
            self._arm_idle()

    async def run(self, code: str, *, time_s: float | None = None) -> RunResult:
        limits = self.limits if time_s is None else _with_time(self.limits, time_s)
        async with self._lock:
            if self._closed_why:
                return sandbox_error(f"the session is closed ({self._closed_why}); open a new one")
            if self._idle is not None:
                self._idle.cancel()
            try:
                return await self._run(code, limits)
            finally:
                self._arm_idle()

    async def _run(self, code: str, limits: Limits) -> RunResult:
        t0 = time.monotonic()
        if self._box is None:
            try:
                self._box = await self._start(self.limits)
            except SandboxError as exc:
                return sandbox_error(str(exc), time.monotonic() - t0)
        box, got, timed_out = self._box, Collected(), False
        self.cells += 1
        try:
            async with asyncio.timeout(limits.time_s + self._grace_s):
                await box.conn.send({"op": "cell", "code": code, "out_limit": limits.output_bytes,
                                     "time_s": limits.time_s})
                await collect(box.conn, limits.output_bytes, got)
        except TimeoutError:
            timed_out = True
        except (OSError, ConnectionError) as exc:
            got.error = f"the interpreter's stream broke: {exc}"
        wall = time.monotonic() - t0
        if got.result is None and wall >= limits.time_s:
            timed_out = True  # the CPU-time rlimit (set above the wall limit) ended it: still a time limit
        if timed_out or got.result is None:
            self._box = None
            oom = box.oom_kills() > 0
            await box.destroy()
            result = run_result(got, RunRequest(code, limits=limits), host_timeout=timed_out, oom=oom, wall_s=wall)
            why = result.message.replace("the program", "the interpreter", 1)
            return _replace(result, message=why + "; the next cell starts a fresh interpreter (state is lost)")
        return _cell_result(got, limits, wall)

    def _arm_idle(self) -> None:
        if not self._closed_why:
            self._idle = asyncio.get_running_loop().call_later(self._idle_s, self._expire)

    def _expire(self) -> None:
        self._expiring = asyncio.get_running_loop().create_task(
            self.aclose(why=f"idle for more than {self._idle_s:g}s"))

    async def aclose(self, why: str = "closed by its owner") -> None:
        if self._closed_why:
            return
        self._closed_why = why
        if self._idle is not None:
            self._idle.cancel()
        box, self._box = self._box, None
        try:
            if box is not None:
                await box.destroy()
        finally:
            self._on_close(self)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _with_time(limits: Limits, time_s: float) -> Limits:
    return Limits(time_s=time_s, memory_mb=limits.memory_mb, pids=limits.pids, file_size_mb=limits.file_size_mb,
                  output_bytes=limits.output_bytes)


def _replace(result: RunResult, **changes: object) -> RunResult:
    import dataclasses

    return dataclasses.replace(result, **changes)  # type: ignore[arg-type]


def _cell_result(got: Collected, limits: Limits, wall: float) -> RunResult:
    r = got.result or {}
    stdout = text(got.stdout, int(r.get("out_bytes", 0)), limits.output_bytes)
    stderr = text(got.stderr, int(r.get("err_bytes", 0)), limits.output_bytes)
    display = tuple(str(d) for d in r.get("display") or ())
    common: dict[str, Any] = {"wall_s": float(r.get("wall_s", wall)), "cpu_s": float(r.get("cpu_s", 0.0)),
                              "display": display}
    if r.get("ok", False):
        return RunResult(RequestStatus.SUCCESS, RunStatus.FINISHED, 0, stdout, stderr, **common)
    if r.get("timed_out"):
        return RunResult(RequestStatus.FAILED, RunStatus.TIME_LIMIT_EXCEEDED, None, stdout, stderr,
                         message=f"the cell ran past its time limit of {limits.time_s:g}s and was interrupted; "
                                 "the interpreter and its state are kept", **common)
    trace = str(r.get("traceback", ""))
    stderr = (stderr + ("\n" if stderr and not stderr.endswith("\n") else "") + trace)[-limits.output_bytes:]
    message = f"{r.get('ename', 'Error')}: {r.get('evalue', '')}"
    return RunResult(RequestStatus.FAILED, RunStatus.ERROR, 1, stdout, stderr, message=message, **common)
