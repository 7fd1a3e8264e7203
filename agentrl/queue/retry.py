"""Retries of transient Redis failures: the shared :class:`agentrl.retry.Retry` with Redis's defaults and errors.

Only errors that mean "the server could not be reached or did not answer" are retried, with jitter (many
producers that lost the same server do not come back in step); a Redis error reply (wrong type, script error)
is a bug, surfaced at once. Either way what the queue gives up on is a :class:`agentrl.errors.QueueError`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import redis.exceptions

from agentrl.errors import QueueError
from agentrl.retry import Retry, RetryOn, covers

T = TypeVar("T")

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,  # includes BusyLoadingError: the server is replaying its AOF
    redis.exceptions.TimeoutError,
    ConnectionError,
    TimeoutError,  # asyncio.timeout around a call that got no answer
)


@dataclass(frozen=True, slots=True)
class RetryPolicy(Retry):
    """How often and how patiently to retry a Redis call that failed transiently. The defaults ride out a Redis
    restart of ~10 s."""

    attempts: int = 10
    base_delay_s: float = 0.05
    max_delay_s: float = 2.0
    jitter: float = 0.5
    retry_on: tuple[type[BaseException], ...] = TRANSIENT_ERRORS

    async def call(self, op: Callable[[], Awaitable[T]], *, what: str, retry_on: RetryOn | None = None,
                   log_level: int = logging.WARNING) -> T:
        """Run ``op`` until it succeeds, retrying transient errors (``retry_on``, default: the policy's);
        raise QueueError when they persist."""
        transient = self.retry_on if retry_on is None else retry_on
        try:
            # Retry.call, not super(): dataclass(slots=True) remade the class, zero-arg super() would not find it
            return await Retry.call(self, op, retry_on=transient, what=what, log_level=log_level)
        except Exception as exc:
            if covers(transient, exc):
                raise QueueError(
                    f"{what} failed {self.attempts} times in a row, last with {type(exc).__name__}: {exc}. "
                    "Expected the Redis server to be reachable; check that it is running "
                    "(AGENTRL_REDIS_URL, or the embedded server of the run directory)"
                ) from exc
            if isinstance(exc, redis.exceptions.RedisError):
                raise QueueError(f"{what} failed: Redis answered {type(exc).__name__}: {exc}") from exc
            raise


NO_RETRY = RetryPolicy(attempts=1)
