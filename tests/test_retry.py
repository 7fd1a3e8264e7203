"""The one retry helper (``agentrl.retry.Retry``) and the Redis policy built on it (``agentrl.queue.RetryPolicy``):
what is retried, how long it waits, what it raises. No server needed; each client's own retries are tested
against a real or misbehaving server in its own tests (engine/test_client_timeouts.py, sandbox/test_server.py,
api/test_api_tasks.py, queue/test_redis_server.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import redis.exceptions

from agentrl.errors import QueueError
from agentrl.queue import RetryPolicy
from agentrl.retry import Retry


class Flaky:
    def __init__(self, failures: list[BaseException]) -> None:
        self.failures = failures
        self.calls = 0

    async def __call__(self) -> str:
        return self.sync()

    def sync(self) -> str:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "ok"


def recording(slept: list[float]) -> Callable[[float], Awaitable[None]]:
    async def sleep(s: float) -> None:
        slept.append(s)
    return sleep


# ------------------------------------------------------------------------------------------ the helper


async def test_retry_on_types_backs_off_exponentially_to_the_cap_then_raises_the_last_error() -> None:
    slept: list[float] = []
    retry = Retry(attempts=4, base_delay_s=0.1, max_delay_s=0.25, sleep=recording(slept))
    op = Flaky([ConnectionRefusedError("1"), ConnectionRefusedError("2"), ConnectionRefusedError("3"),
                ConnectionRefusedError("4")])
    with pytest.raises(ConnectionRefusedError, match="4"):
        await retry.call(op, retry_on=ConnectionError, what="x")
    assert op.calls == 4 and slept == [0.1, 0.2, 0.25]


async def test_an_error_retry_on_does_not_cover_is_raised_at_once() -> None:
    slept: list[float] = []
    op = Flaky([ConnectionRefusedError(), KeyError("bug")])
    with pytest.raises(KeyError):
        await Retry(attempts=5, base_delay_s=0.1, sleep=recording(slept)).call(op, retry_on=ConnectionError,
                                                                               what="x")
    assert op.calls == 2 and slept == [0.1]


async def test_retry_on_may_be_a_predicate_and_op_any_callable_returning_an_awaitable() -> None:
    slept: list[float] = []
    op = Flaky([ValueError("busy"), ValueError("busy"), ValueError("bad")])
    retry = Retry(attempts=5, base_delay_s=0.1, sleep=recording(slept))
    with pytest.raises(ValueError, match="bad"):
        await retry.call(lambda: op(), retry_on=lambda e: str(e) == "busy", what="x")
    assert op.calls == 3 and slept == [0.1, 0.2]


def test_the_blocking_form_follows_the_same_policy() -> None:
    op = Flaky([TimeoutError(), TimeoutError()])
    assert Retry(attempts=3, base_delay_s=0.001).call_sync(op.sync, retry_on=TimeoutError, what="x") == "ok"
    assert op.calls == 3
    op = Flaky([TimeoutError()] * 2)
    with pytest.raises(TimeoutError):
        Retry(attempts=2, base_delay_s=0.001).call_sync(op.sync, retry_on=TimeoutError, what="x")
    assert op.calls == 2


async def test_one_deadline_around_the_call_covers_its_retries_and_sleeps() -> None:
    op = Flaky([ConnectionRefusedError()] * 100)
    retry = Retry(attempts=100, base_delay_s=0.2)  # its sleeps alone would take minutes
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):
            await retry.call(op, retry_on=ConnectionError, what="x")
    assert loop.time() - t0 < 5 and op.calls < 5


def test_jitter_stays_within_bounds() -> None:
    p = Retry(base_delay_s=1.0, max_delay_s=8.0, jitter=0.5)
    for retry, cap in ((1, 1.0), (3, 4.0), (10, 8.0)):
        assert all(cap * 0.5 <= p.delay_s(retry) <= cap for _ in range(50))


def test_attempts_and_jitter_are_checked() -> None:
    with pytest.raises(ValueError):
        Retry(attempts=0)
    with pytest.raises(ValueError):
        Retry(jitter=1.5)


# ------------------------------------------------------------------------------------------ the Redis policy


def policy(attempts: int, slept: list[float]) -> RetryPolicy:
    return RetryPolicy(attempts=attempts, base_delay_s=0.1, max_delay_s=0.25, jitter=0.0, sleep=recording(slept))


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


def test_the_redis_policy_keeps_its_defaults() -> None:
    p = RetryPolicy()
    assert (p.attempts, p.base_delay_s, p.max_delay_s, p.jitter) == (10, 0.05, 2.0, 0.5)
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)


def test_the_delay_stays_capped_however_many_failures() -> None:
    assert Retry(base_delay_s=1.0, max_delay_s=30.0).delay_s(5000) == 30.0  # a pool failing for days
