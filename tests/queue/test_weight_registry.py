"""WeightRegistry against real Redis servers: publish/latest/get, rewind, wait_for."""

from __future__ import annotations

import asyncio
import random

import pytest
import redis.asyncio

from agentrl.queue import VersionWaitTimeout, WeightRegistry, WeightVersionError

pytestmark = pytest.mark.redis


async def test_publish_latest_get(client: redis.asyncio.Redis, name: str) -> None:
    reg = WeightRegistry(client, name)
    assert await reg.latest() is None
    v1 = await reg.publish(1, "/w/v1", step=10, metrics={"loss": 0.5})
    await reg.publish(3, "/w/v3", step=30)
    await reg.publish(2, "/w/v2", step=20)  # out of order: latest stays 3
    latest = await reg.latest()
    assert latest is not None and (latest.version, latest.path, latest.step) == (3, "/w/v3", 30)
    assert await reg.get(1) == v1 and v1.metrics == {"loss": 0.5}
    with pytest.raises(WeightVersionError, match="not registered"):
        await reg.get(7)


async def test_republish_same_path_ok_other_path_refused(client: redis.asyncio.Redis, name: str) -> None:
    reg = WeightRegistry(client, name)
    await reg.publish(1, "/w/v1", step=1)
    again = await reg.publish(1, "/w/v1", step=2)  # a resumed trainer re-publishing
    assert (await reg.get(1)).step == again.step == 2
    with pytest.raises(WeightVersionError, match="already published at /w/v1"):
        await reg.publish(1, "/w/v1-other", step=3)
    with pytest.raises(WeightVersionError):
        await reg.publish(1, "/w/v", step=3)  # a prefix of the old path is still another path


async def test_rewind_forgets_later_versions_so_waiters_wait_for_the_republish(client: redis.asyncio.Redis,
                                                                                name: str) -> None:
    reg = WeightRegistry(client, name)
    for v in range(4):
        await reg.publish(v, f"/w/v{v}", step=v)
    assert await reg.rewind(1) == 2
    latest = await reg.latest()
    assert latest is not None and latest.version == 1
    with pytest.raises(WeightVersionError, match="not registered"):
        await reg.get(2)
    waiter = asyncio.ensure_future(reg.wait_for(2, timeout_s=10))
    await asyncio.sleep(0.2)
    assert not waiter.done()  # v2 of the crashed run is forgotten: wait for the resumed trainer's
    await reg.publish(2, "/w/v2", step=2)
    assert (await waiter).version == 2
    assert await reg.rewind(-1) == 3 and await reg.latest() is None


async def test_wait_for_returns_at_once_or_on_publish(client: redis.asyncio.Redis, name: str) -> None:
    reg = WeightRegistry(client, name)
    await reg.publish(1, "/w/v1", step=1)
    assert (await reg.wait_for(1, timeout_s=1)).version == 1
    waiter = asyncio.create_task(reg.wait_for(3, timeout_s=30))
    await reg.publish(2, "/w/v2", step=2)  # not enough
    await asyncio.sleep(0.1)
    assert not waiter.done()
    await reg.publish(3, "/w/v3", step=3)
    assert (await asyncio.wait_for(waiter, 10)).version == 3


async def test_wait_for_never_misses_a_racing_publish(client: redis.asyncio.Redis, name: str) -> None:
    reg = WeightRegistry(client, name)
    rng = random.Random(0)

    async def publish_soon(v: int) -> None:
        for _ in range(rng.randrange(4)):
            await asyncio.sleep(0)  # lands before, between, or after the waiter's check and block
        await reg.publish(v, f"/w/v{v}", step=v)

    for v in range(1, 31):
        got, _ = await asyncio.gather(reg.wait_for(v, timeout_s=10), publish_soon(v))
        assert got.version == v


async def test_wait_for_times_out(client: redis.asyncio.Redis, name: str) -> None:
    reg = WeightRegistry(client, name)
    await reg.publish(1, "/w/v1", step=1)
    with pytest.raises(VersionWaitTimeout, match="no weight version >= 2") as err:
        await reg.wait_for(2, timeout_s=0.1)
    assert isinstance(err.value, TimeoutError)
