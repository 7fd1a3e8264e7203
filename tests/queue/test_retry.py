"""RetryPolicy logic (no server needed): what is retried, how long it waits, what it raises."""

from __future__ import annotations

import pytest
import redis.exceptions

from agentrl.errors import QueueError
from agentrl.queue import RetryPolicy


class Flaky:
    def __init__(self, failures: list[BaseException]) -> None:
        self.failures = failures
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "ok"


def policy(attempts: int, slept: list[float]) -> RetryPolicy:
    async def sleep(s: float) -> None:
        slept.append(s)
    return RetryPolicy(attempts=attempts, base_delay_s=0.1, max_delay_s=0.25, jitter=0.0, sleep=sleep)


async def test_transient_errors_are_retried_with_capped_exponential_backoff() -> None:
    slept: list[float] = []
    op = Flaky([redis.exceptions.ConnectionError("refused"), redis.exceptions.BusyLoadingError("loading"),
                TimeoutError(), ConnectionResetError()])
    assert await policy(5, slept).call(op, what="put") == "ok"
    assert op.calls == 5
    assert slept == [0.1, 0.2, 0.25, 0.25]


async def test_persistent_failure_becomes_queue_error() -> None:
    slept: list[float] = []
    op = Flaky([redis.exceptions.ConnectionError("refused")] * 3)
    with pytest.raises(QueueError, match="put failed 3 times in a row.*refused.*reachable"):
        await policy(3, slept).call(op, what="put")
    assert op.calls == 3 and len(slept) == 2


async def test_error_replies_are_not_retried() -> None:
    slept: list[float] = []
    op = Flaky([redis.exceptions.ResponseError("WRONGTYPE Operation against a key")])
    with pytest.raises(QueueError, match="WRONGTYPE"):
        await policy(5, slept).call(op, what="ack")
    assert op.calls == 1 and slept == []


async def test_other_exceptions_pass_through() -> None:
    op = Flaky([KeyError("bug")])
    with pytest.raises(KeyError):
        await policy(5, []).call(op, what="x")


def test_jitter_stays_within_bounds() -> None:
    p = RetryPolicy(base_delay_s=1.0, max_delay_s=8.0, jitter=0.5)
    for retry, cap in ((1, 1.0), (3, 4.0), (10, 8.0)):
        assert all(cap * 0.5 <= p.delay_s(retry) <= cap for _ in range(50))


def test_attempts_must_be_positive() -> None:
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)
