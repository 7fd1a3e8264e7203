"""MathVerifier: a pool of checker processes that bounds every math check in time.

Why processes: math-verify (sympy) can spin for minutes on adversarial LaTeX, its timeouts use SIGALRM (main
thread only), and some of the work happens in C where no signal lands. Each worker runs checks in its own
main thread under a soft deadline of ``timeout_s`` seconds of the worker's CPU time (so a loaded machine does
not turn slow-but-fine checks into timeouts); the parent waits ``hard_timeout_s`` of wall-clock time
(default ``3 * timeout_s + 2``) and then kills the worker and starts a replacement. So a check returns within
``hard_timeout_s`` after it gets a worker, whatever the input.

Cheap work stays in the caller: the answer is extracted here (linear scans) and anything longer than
``max_answer_chars`` is refused before it reaches a worker, so megabyte responses never cross the pipe.

Back-pressure: at most ``max_pending`` checks are admitted at once (in flight or waiting for a worker); more
callers wait. Pass a shared ``asyncio.Semaphore`` as ``limiter`` to bound several reward functions together.

Outcomes: a timeout is the answer's verdict (TIMEOUT, not equal): the clock starts only once a worker has the
check, so queueing never causes it. A worker that dies mid-check is replaced and the check retried once on a
fresh worker; a second death gives CHECKER_ERROR. Workers that cannot start raise
:class:`~agentrl.rewards.base.VerifierError` (infrastructure: no score).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from typing import Self

from agentrl.errors import ConfigError
from agentrl.models import child_env
from agentrl.rewards import _normalize as norm
from agentrl.rewards._equivalence import MAX_ANSWER_CHARS, Verdict, no_answer_verdict
from agentrl.rewards.base import VerifierError

log = logging.getLogger(__name__)

_BROKEN = None  # put into the idle queue when a replacement worker cannot start


class _WorkerDied(Exception):
    pass


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def request(self, payload: dict[str, object]) -> Verdict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(payload) + "\n").encode())
        try:
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise _WorkerDied() from exc
        line = await self.proc.stdout.readline()
        try:
            return Verdict(json.loads(line)["verdict"])
        except (ValueError, KeyError, TypeError) as exc:  # EOF (b"") or garbage: the worker is gone or broken
            raise _WorkerDied() from exc

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await self.proc.wait()


class MathVerifier:
    """Async, time-bounded math checks on a pool of worker processes. Use ``async with`` or ``aclose()``."""

    def __init__(
        self,
        *,
        workers: int = 2,
        max_pending: int = 64,
        timeout_s: float = 5.0,
        hard_timeout_s: float | None = None,
        start_timeout_s: float = 120.0,
        max_answer_chars: int = MAX_ANSWER_CHARS,
        memory_mb: int = 2048,
        limiter: asyncio.Semaphore | None = None,
        python: str = sys.executable,
    ) -> None:
        if workers < 1 or max_pending < 1 or timeout_s <= 0:
            raise ConfigError(
                f"MathVerifier needs workers >= 1, max_pending >= 1, timeout_s > 0; got workers={workers}, "
                f"max_pending={max_pending}, timeout_s={timeout_s}"
            )
        self._size = workers
        self._timeout_s = timeout_s
        self._hard_timeout_s = 3 * timeout_s + 2.0 if hard_timeout_s is None else hard_timeout_s
        self._start_timeout_s = start_timeout_s
        self._max_chars = max_answer_chars
        self._memory_mb = memory_mb
        self._python = python
        self._limiter = limiter or asyncio.Semaphore(max_pending)
        self._idle: asyncio.Queue[_Worker | None] = asyncio.Queue()
        self._all: set[_Worker] = set()
        self._spawners: set[asyncio.Task[None]] = set()
        self._started = False
        self._closed = False
        self._start_lock = asyncio.Lock()
        self.replaced_workers = 0  # workers killed (timeout) or found dead and replaced; for metrics

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (for metrics and tests)."""
        return [w.proc.pid for w in self._all]

    async def start(self) -> None:
        """Start the workers and wait until they are ready (done lazily by the first check otherwise)."""
        async with self._start_lock:
            if self._closed:
                raise VerifierError("MathVerifier is closed; create a new one")
            if self._started:
                return
            try:
                async with asyncio.TaskGroup() as group:  # one failure cancels (and kills) the other spawns
                    spawns = [group.create_task(self._spawn()) for _ in range(self._size)]
            except ExceptionGroup as group_error:
                first = group_error.exceptions[0]
                raise (
                    first if isinstance(first, VerifierError) else VerifierError(repr(first))
                ) from group_error
            for spawn in spawns:
                self._idle.put_nowait(spawn.result())
            self._started = True

    async def verify(self, response_text: str, reference: str) -> Verdict:
        """Extract the answer from a whole model response and check it against ``reference``."""
        answer = norm.extract_answer(response_text)
        if answer is None:
            return no_answer_verdict(response_text)
        return await self.check(answer, reference)

    async def check(self, answer: str, reference: str) -> Verdict:
        """Check an already-extracted answer; returns within ``hard_timeout_s`` once a worker is free."""
        if len(answer) > self._max_chars:
            return Verdict.TOO_LONG
        if not answer.strip():
            return Verdict.NO_ANSWER
        payload = {
            "answer": answer,
            "reference": reference,
            "timeout_s": self._timeout_s,
            "max_chars": self._max_chars,
        }
        async with self._limiter:
            if not self._started:
                await self.start()
            for _attempt in range(2):
                try:
                    return await self._run_once(payload)
                except _WorkerDied:
                    if self._closed:
                        raise VerifierError("MathVerifier was closed during a check") from None
                    log.warning("math checker worker died during a check; retrying on a fresh worker")
            return Verdict.CHECKER_ERROR

    async def aclose(self) -> None:
        """Kill the workers and stop pending replacements (idempotent)."""
        self._closed = True
        for task in list(self._spawners):
            task.cancel()
        await asyncio.gather(*self._spawners, return_exceptions=True)
        await asyncio.gather(*(w.kill() for w in list(self._all)), return_exceptions=True)
        self._all.clear()
        self._idle.put_nowait(_BROKEN)  # wakes checks still waiting for a worker

    async def _run_once(self, payload: dict[str, object]) -> Verdict:
        worker = await self._acquire()
        try:
            async with asyncio.timeout(self._hard_timeout_s):
                verdict = await worker.request(payload)
        except TimeoutError:
            log.warning("math check exceeded %.1fs; killing its worker", self._hard_timeout_s)
            self._replace(worker)
            return Verdict.TIMEOUT
        except BaseException:  # died, or the caller was cancelled mid-exchange: the worker's state is unknown
            self._replace(worker)
            raise
        self._idle.put_nowait(worker)
        return verdict

    async def _acquire(self) -> _Worker:
        if self._closed:
            raise VerifierError("MathVerifier is closed; create a new one")
        worker = await self._idle.get()
        if worker is _BROKEN:
            if self._closed:  # aclose() wakes waiters this way; pass it on to the next one
                self._idle.put_nowait(_BROKEN)
                raise VerifierError("MathVerifier was closed while this check waited for a worker")
            # a replacement failed to start: this caller gets the error, and the slot tries again
            self._start_replacement(None)
            raise VerifierError("a math checker worker could not be (re)started; see the log for the cause")
        return worker

    def _replace(self, worker: _Worker) -> None:
        self.replaced_workers += 1
        self._all.discard(worker)
        self._start_replacement(worker)

    def _start_replacement(self, old: _Worker | None) -> None:
        task = asyncio.create_task(self._replace_task(old))
        self._spawners.add(task)
        task.add_done_callback(self._spawners.discard)

    async def _replace_task(self, old: _Worker | None) -> None:
        if old is not None:
            await old.kill()
        if self._closed:
            return
        try:
            worker = await self._spawn()
        except VerifierError:
            log.exception("could not start a replacement math checker worker")
            self._idle.put_nowait(_BROKEN)
            return
        self._idle.put_nowait(worker)

    async def _spawn(self) -> _Worker:
        env = child_env()
        try:
            proc = await asyncio.create_subprocess_exec(
                self._python,
                "-m",
                "agentrl.rewards._verifier_worker",
                "--memory-mb",
                str(self._memory_mb),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env=env,
            )
        except OSError as exc:
            raise VerifierError(
                f"could not start a math checker worker with {self._python!r}: {exc}"
            ) from exc
        worker = _Worker(proc)
        self._all.add(worker)
        try:
            assert proc.stdout is not None
            async with asyncio.timeout(self._start_timeout_s):
                line = await proc.stdout.readline()
            if json.loads(line or b"{}").get("ready") is not True:
                raise VerifierError(
                    f"math checker worker exited while starting (exit code {proc.returncode})"
                )
        except BaseException as exc:
            self._all.discard(worker)
            await worker.kill()
            if isinstance(exc, (TimeoutError, ValueError)):
                raise VerifierError(
                    f"math checker worker not ready after {self._start_timeout_s:.0f}s ({exc!r}); "
                    "is math-verify installed in this interpreter?"
                ) from exc
            raise
        return worker
