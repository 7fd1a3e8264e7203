import asyncio

import pytest

from agentrl.async_rollout.staleness import StalenessManager


def test_capacity_formula():
    m = StalenessManager(groups_per_step=4, max_staleness=1, max_running=100)
    assert m.capacity() == (1 + 0 + 1) * 4  # 8 groups may start on version 0
    m.started, m.running = 8, 3
    assert m.capacity() == 0
    m.version = 1
    assert m.capacity() == 4
    m.max_running = 5
    assert m.capacity() == 2  # concurrency bound wins


async def test_synchronous_when_eta_is_zero():
    m = StalenessManager(groups_per_step=2, max_staleness=0, max_running=8)
    assert [await m.acquire(), await m.acquire()] == [0, 1]
    third = asyncio.create_task(m.acquire())
    await asyncio.sleep(0.05)
    assert not third.done(), "a third group must wait for version 1"
    await m.release()
    await m.release()
    await asyncio.sleep(0.05)
    assert not third.done(), "finishing groups does not help: only a new version does"
    await m.set_version(1)
    assert await asyncio.wait_for(third, 1) == 2


async def test_requeue_gives_admission_back():
    m = StalenessManager(groups_per_step=1, max_staleness=0, max_running=1)
    await m.acquire()
    await m.release(requeue=True)
    assert m.stats().capacity == 1 and m.started == 0


@pytest.mark.parametrize("args", [{"groups_per_step": 0, "max_staleness": 0, "max_running": 1},
                                  {"groups_per_step": 1, "max_staleness": -1, "max_running": 1}])
def test_bad_arguments_are_rejected(args):
    with pytest.raises(ValueError, match="expected"):
        StalenessManager(**args)
