"""One retry helper for every client: try a call again when it failed in a way that cannot have had an effect.

    retry = Retry(attempts=4, base_delay_s=0.5, max_delay_s=8.0)       # injected: how patient
    async with asyncio.timeout(30):                                   # the caller's one deadline, sleeps included
        body = await retry.call(fetch, retry_on=(ConnectionRefusedError, Busy), what="GET /model_info")

The *policy* is a frozen value the user injects (the redis-py ``Retry`` habit): how many attempts, how long
between them. *What* may be retried is the client's to say (``retry_on``: exception types or a predicate),
because only the client knows which failures left no effect behind. The delay before retry k (k = 1, 2, …) is

    min(max_delay_s, base_delay_s * 2**(k-1)) * u,   u uniform in [1 - jitter, 1]

so the cap holds with jitter too, and many clients that lost the same server do not come back in step. When
the attempts run out the last error propagates unchanged, and each client turns it into its own error
(``EngineError``, ``QueueError``, ``SandboxError``, ``ApiError``) with what it knows. A deadline is not the
policy's business: the caller wraps the whole ``call`` in ``asyncio.timeout``, so one deadline covers every
attempt and every sleep and no call can outlive it.

The loop is tenacity's (``AsyncRetrying`` / ``Retrying``: the same policy drives async and blocking clients,
with an injected sleep for tests). ``call`` makes its first attempt before tenacity: setting up tenacity's loop
took ~27 µs per call, more than the Redis command it wraps (three per batch of the trajectory queue), so the loop
is built only once a first attempt failed in a way ``retry_on`` covers. stamina, the other candidate, wraps tenacity as well but is configured for
tests through process-wide switches (``set_testing``) and adds its jitter on top of the cap; we want neither.
This module imports nothing of agentrl, so every package (the sandbox on the lowest floor too) may use it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import tenacity

log = logging.getLogger(__name__)
T = TypeVar("T")

RetryOn = type[BaseException] | tuple[type[BaseException], ...] | Callable[[BaseException], bool]


@dataclass(frozen=True, slots=True)
class Retry:
    """How often and how patiently to retry. ``attempts`` counts every try (1 = no retry)."""

    attempts: int = 4
    base_delay_s: float = 0.5  # before the first retry; doubles for each next one
    max_delay_s: float = 8.0
    jitter: float = 0.0  # each delay is scaled by a factor drawn from [1 - jitter, 1]
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # of ``call`` (``call_sync`` sleeps the thread)

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"{type(self).__name__}.attempts must be >= 1, got {self.attempts}")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"{type(self).__name__}.jitter must be in [0, 1], got {self.jitter}")

    def delay_s(self, retry: int) -> float:
        """Delay before retry number ``retry`` (1-based)."""
        raw = min(self.max_delay_s, self.base_delay_s * 2.0 ** min(retry - 1, 512))  # 2.0**1024 overflows
        return raw * (1.0 - self.jitter * random.random())

    async def call(self, op: Callable[[], Awaitable[T]], *, retry_on: RetryOn, what: str,
                   log_level: int = logging.DEBUG) -> T:
        """``await op()`` until it succeeds, an error ``retry_on`` does not cover is raised (at once), or the
        attempts run out (then the last error is raised)."""
        try:  # attempt 1 without tenacity's set-up (module docstring)
            return await op()
        except BaseException as exc:
            if self.attempts == 1 or not covers(retry_on, exc):
                raise
            delay = self.delay_s(1)
            self._log_retry(log_level, what, exc, 1, delay)
        await self.sleep(delay)

        async def attempt() -> T:  # a coroutine function, whatever ``op`` is (tenacity calls others as blocking)
            return await op()

        retrying = tenacity.AsyncRetrying(sleep=self.sleep, **self._loop(retry_on, what, log_level, done=1))
        result: T = await retrying(attempt)
        return result

    def call_sync(self, op: Callable[[], T], *, retry_on: RetryOn, what: str, log_level: int = logging.DEBUG) -> T:
        """``call`` for blocking code."""
        return tenacity.Retrying(**self._loop(retry_on, what, log_level))(op)

    def _loop(self, retry_on: RetryOn, what: str, log_level: int, done: int = 0) -> dict[str, Any]:
        """tenacity's settings for the attempts after the first ``done`` (already made and failed)."""
        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            delay = state.next_action.sleep if state.next_action is not None else 0.0
            self._log_retry(log_level, what, exc, done + state.attempt_number, delay)

        return {"stop": tenacity.stop_after_attempt(self.attempts - done),
                "wait": lambda state: self.delay_s(done + state.attempt_number),
                "retry": tenacity.retry_if_exception(lambda exc: covers(retry_on, exc)),
                "before_sleep": before_sleep, "reraise": True}

    def _log_retry(self, level: int, what: str, exc: BaseException | None, retry: int, delay: float) -> None:
        log.log(level, "%s failed (%s: %s); retry %d/%d in %.2fs", what, type(exc).__name__, exc,
                retry, self.attempts - 1, delay)


def covers(retry_on: RetryOn, exc: BaseException) -> bool:
    """Whether ``retry_on`` (exception types, or a predicate) says ``exc`` may be retried."""
    if isinstance(retry_on, (type, tuple)):
        return isinstance(exc, retry_on)
    return retry_on(exc)
