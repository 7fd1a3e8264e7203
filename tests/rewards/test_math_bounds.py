"""Every math check returns, on any input: adversarial LaTeX, megabyte strings, stuck or dying workers."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import sys
from pathlib import Path

import psutil
import pytest

from agentrl.errors import ConfigError
from agentrl.rewards import (
    MathReward,
    MathVerifier,
    RewardInput,
    RewardStatus,
    Verdict,
    VerifierError,
    check_answer,
)
from agentrl.types import Task

ADVERSARIAL = {
    "exponent_tower": r"\boxed{10^{10^{10^{10}}}}",
    "huge_factorial": r"\boxed{99999999999!}",
    "factorial_chain": r"\boxed{9!!!!!!!}",
    "nested_fracs_20": "\\boxed{" + "\\frac{" * 20 + "1" + "}{2}" * 20 + "}",
    "nested_parens_20": "\\boxed{" + "(" * 20 + "1" + ")" * 20 + "}",
    "nested_braces_100k": "\\boxed{" + "{" * 100_000 + "}" * 100_000 + "}",
    "one_megabyte_sum": "\\boxed{" + "1+" * 500_000 + "1}",
    "one_megabyte_no_answer": "x" * 1_000_000,
    "one_megabyte_unclosed": "\\boxed{" + "a" * 1_000_000,
    "one_megabyte_backslashes": "\\boxed{" + "\\" * 1_000_000,
    "many_boxes": "\\boxed{1}" * 100_000 + "\\boxed{",
    "long_product": "\\boxed{" + "x" * 999 + "}",
    "many_items": "\\boxed{" + ",".join(["x^{99}"] * 40) + "}",
    "answer_tags_1mb": "<answer>" * 100_000 + "</answer>" * 10,
}


@pytest.mark.timeout(300)
async def test_adversarial_inputs_return_false_through_the_pool() -> None:
    async with MathVerifier(workers=2, timeout_s=1.0) as pool:
        # against "2": none of them equals it, while ((((1)))) does equal "1" (a verdict that depended on whether
        # the check finished within its 1 s budget on a loaded machine: the suite once got EQUAL)
        verdicts = await asyncio.gather(*(pool.verify(text, "2") for text in ADVERSARIAL.values()))
        assert [v for v in verdicts if v is Verdict.EQUAL] == []
        assert await pool.verify(r"\boxed{1}", "1") is Verdict.EQUAL  # the pool still works afterwards


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name", ["exponent_tower", "nested_fracs_20", "one_megabyte_sum", "nested_braces_100k"]
)
def test_adversarial_inputs_in_process_hit_the_soft_deadline(name: str) -> None:
    assert check_answer(ADVERSARIAL[name], "1", timeout_s=1.0) is not Verdict.EQUAL


@pytest.mark.timeout(120)
async def test_a_stuck_worker_is_killed_and_replaced() -> None:
    async with MathVerifier(workers=1, timeout_s=0.5, hard_timeout_s=1.0) as pool:
        (pid,) = pool.worker_pids
        os.kill(pid, signal.SIGSTOP)  # stuck where no SIGALRM can reach it (as code stuck in C would be)
        assert await pool.verify(r"\boxed{1}", "1") is Verdict.TIMEOUT
        assert pool.replaced_workers == 1
        assert await pool.verify(r"\boxed{1}", "1") is Verdict.EQUAL  # on the replacement
        assert pool.worker_pids != [pid]


@pytest.mark.timeout(120)
async def test_a_dead_worker_is_replaced_and_the_check_retried() -> None:
    async with MathVerifier(workers=1, timeout_s=2.0) as pool:
        (pid,) = pool.worker_pids
        os.kill(pid, signal.SIGKILL)
        assert await pool.verify(r"\boxed{\frac{1}{2}}", "0.5") is Verdict.EQUAL
        assert pool.replaced_workers == 1


async def computing(pool: MathVerifier, timeout_s: float = 30.0) -> None:
    """Return once the pool's only worker is computing (its CPU time grows): a check has reached it."""
    (pid,) = pool.worker_pids
    worker = psutil.Process(pid)
    idle = sum(worker.cpu_times()[:2])
    async with asyncio.timeout(timeout_s):
        while sum(worker.cpu_times()[:2]) - idle < 0.05:
            await asyncio.sleep(0.01)


@pytest.mark.timeout(120)
async def test_a_cancelled_check_does_not_desynchronise_the_worker() -> None:
    async with MathVerifier(workers=1, timeout_s=3.0) as pool:
        slow = asyncio.create_task(pool.verify(ADVERSARIAL["exponent_tower"], "1"))
        await computing(pool)  # cancelled mid-exchange: the worker owes a reply
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        # a worker that still owed the cancelled reply would answer this with the wrong verdict
        assert await pool.verify(r"\boxed{7}", "7") is Verdict.EQUAL
        assert await pool.verify(r"\boxed{8}", "7") is Verdict.NOT_EQUAL


class CountingSemaphore(asyncio.Semaphore):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.in_use = self.peak = 0

    async def acquire(self) -> bool:
        await super().acquire()
        self.in_use += 1
        self.peak = max(self.peak, self.in_use)
        return True

    def release(self) -> None:
        self.in_use -= 1
        super().release()


async def test_back_pressure_bounds_admitted_checks() -> None:
    limiter = CountingSemaphore(2)
    async with MathVerifier(workers=1, limiter=limiter) as pool:
        results = await asyncio.gather(*(pool.verify(rf"\boxed{{{i}}}", str(i)) for i in range(20)))
    assert set(results) == {Verdict.EQUAL}
    assert limiter.peak == 2 and limiter.in_use == 0


async def test_workers_that_cannot_start_are_an_infrastructure_error() -> None:
    pool = MathVerifier(workers=1, python="/nonexistent/python3")
    reward = MathReward(pool)
    result = await reward(Task(id="t", prompt="1+1?", answer="2"), RewardInput(text=r"\boxed{2}"))
    assert result.status is RewardStatus.INFRA_ERROR and math.isnan(result.score)
    assert "/nonexistent/python3" in result.details["error"]
    await pool.aclose()
    with pytest.raises(VerifierError):
        await pool.check("2", "2")


@pytest.mark.timeout(120)
async def test_pool_recovers_after_workers_could_not_be_restarted(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\n[ -e "{broken}" ] && exit 1\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    reward_task, response = Task(id="t", prompt="?", answer="3"), RewardInput(text=r"\boxed{3}")
    async with MathVerifier(workers=1, python=str(python)) as pool:
        reward = MathReward(pool)
        broken.touch()
        os.kill(pool.worker_pids[0], signal.SIGKILL)
        failed = await reward(reward_task, response)
        assert failed.status is RewardStatus.INFRA_ERROR
        broken.unlink()
        for _ in range(3):  # the slot retries on the next check; at most one more caller sees the old error
            result = await reward(reward_task, response)
            if result.ok:
                break
        assert result.ok and result.score == 1.0


async def test_checks_waiting_for_a_worker_fail_cleanly_on_close() -> None:
    pool = MathVerifier(workers=1, timeout_s=3.0)
    await pool.start()
    checks = [asyncio.create_task(pool.verify(ADVERSARIAL["exponent_tower"], "1")) for _ in range(3)]
    await computing(pool)  # one check holds the only worker, two wait for it
    await pool.aclose()
    outcomes = await asyncio.gather(*checks, return_exceptions=True)
    assert all(isinstance(o, VerifierError) for o in outcomes), outcomes


async def test_math_reward_scores(verifier: MathVerifier) -> None:
    reward = MathReward(verifier)
    task = Task(id="t", prompt="2+2?", answer="4")
    right = await reward(task, RewardInput(text=r"thinking... \boxed{4}"))
    wrong = await reward(task, RewardInput(text=r"\boxed{5}"))
    missing = await reward(task, RewardInput(text="four"))
    assert (right.score, right.status, right.details["verdict"], right.details["answer"]) == (
        1.0,
        RewardStatus.OK,
        "equal",
        "4",
    )
    assert (wrong.score, wrong.details["verdict"]) == (0.0, "not_equal")
    assert (missing.score, missing.status, missing.details["verdict"]) == (0.0, RewardStatus.OK, "no_answer")


async def test_math_reward_needs_a_reference(verifier: MathVerifier) -> None:
    with pytest.raises(ConfigError, match="no reference answer"):
        await MathReward(verifier)(Task(id="t", prompt="?"), RewardInput(text=r"\boxed{1}"))


async def test_math_reward_owns_the_pool_it_builds() -> None:
    async with MathReward(workers=1) as reward:
        result = await reward(Task(id="t", prompt="?", answer="0.5"), RewardInput(text=r"\boxed{\frac12}"))
        assert result.score == 1.0
        pool = reward._verifier
    with pytest.raises(VerifierError):
        await pool.check("1", "1")
