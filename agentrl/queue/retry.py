"""Retries of transient Redis failures, as an injected object (the redis-py ``Retry`` habit).

Delay before retry k (k = 1, 2, …) is ``min(max_delay_s, base_delay_s * 2**(k-1))`` scaled by a jitter factor
drawn uniformly from ``[1 - jitter, 1]``, so many producers that lost the same server do not come back in step.
Only errors that mean "the server could not be reached or did not answer" are retried; a Redis error reply
(wrong type, script error) is a bug, surfaced at once as :class:`agentrl.errors.QueueError`.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import redis.exceptions

from agentrl.errors import QueueError

log = logging.getLogger(__name__)
T = TypeVar("T")

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,  # includes BusyLoadingError: the server is replaying its AOF
    redis.exceptions.TimeoutError,
    ConnectionError,
    TimeoutError,  # asyncio.timeout around a call that got no answer
)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how patiently to retry a Redis call that failed transiently.

    ``attempts`` counts every try (1 = no retry). The defaults ride out a Redis restart of ~10 s.
    """

    attempts: int = 10
    base_delay_s: float = 0.05
    max_delay_s: float = 2.0
    jitter: float = 0.5
    retry_on: tuple[type[BaseException], ...] = TRANSIENT_ERRORS
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")

    def delay_s(self, retry: int) -> float:
        """Delay before retry number ``retry`` (1-based)."""
        raw = min(self.max_delay_s, self.base_delay_s * 2 ** (retry - 1))
        return raw * (1.0 - self.jitter * random.random())

    async def call(self, op: Callable[[], Awaitable[T]], *, what: str) -> T:
        """Run ``op`` until it succeeds, retrying transient errors; raise QueueError when they persist."""
        for attempt in range(1, self.attempts + 1):
            try:
                return await op()
            except self.retry_on as exc:
                if attempt == self.attempts:
                    raise QueueError(
                        f"{what} failed {self.attempts} times in a row, last with {type(exc).__name__}: {exc}. "
                        "Expected the Redis server to be reachable; check that it is running "
                        "(AGENTRL_REDIS_URL, or the embedded server of the run directory)"
                    ) from exc
                delay = self.delay_s(attempt)
                log.warning("%s failed (%s: %s); retry %d/%d in %.2fs",
                            what, type(exc).__name__, exc, attempt, self.attempts - 1, delay)
                await self.sleep(delay)
            except redis.exceptions.RedisError as exc:
                raise QueueError(f"{what} failed: Redis answered {type(exc).__name__}: {exc}") from exc
        raise AssertionError("unreachable")  # pragma: no cover


NO_RETRY = RetryPolicy(attempts=1)
