"""The embedded Redis (start, persistence across restarts, one server per directory) and connect_redis."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from queue_support import free_port, make_trajectory

from agentrl.errors import ConfigError, QueueError
from agentrl.queue import (
    EmbeddedRedis,
    RetryPolicy,
    TrajectoryQueue,
    check_redis_version,
    connect_redis,
)
from agentrl.queue.redis_server import redact_url, verify_server

pytestmark = pytest.mark.redis


@pytest.mark.parametrize("crash", [False, True], ids=["stopped", "killed"])
async def test_restart_on_same_dir_keeps_every_unacked_entry(tmp_path: Path, crash: bool) -> None:
    sent = [make_trajectory(version=i) for i in range(8)]
    async with await connect_redis(data_dir=tmp_path) as handle:
        assert handle.embedded is not None and handle.version >= (6, 2, 0)
        q = TrajectoryQueue(handle.client, "run:traj", consumer="trainer-0")
        await q.put(sent)
        used = await q.read(3, timeout_s=1)
        await q.ack([used[0].entry_id])  # committed and acked
        in_flight = used[1:]  # read, not acked
        if crash:
            pid, proc = handle.embedded.pid, handle.embedded._proc
            assert pid is not None and proc is not None, "the embedded server must be running here"
            os.kill(pid, signal.SIGKILL)  # never a pid of 0: that would be this test's own process group
            proc.wait(10)
    assert (tmp_path / "redis.log").stat().st_size > 0
    async with await connect_redis(data_dir=tmp_path) as handle:
        q = TrajectoryQueue(handle.client, "run:traj", consumer="trainer-0")
        stats = await q.stats()
        assert (stats.length, stats.pending) == (7, 2)
        again = await q.read(10, timeout_s=1)
        assert [e.entry_id for e in again] == [e.entry_id for e in in_flight]  # own uncommitted work first
        rest = await q.read(10, timeout_s=1)
        assert [e.trajectory for e in again + rest] == sent[1:]


async def test_second_connect_attaches_to_the_running_server(tmp_path: Path) -> None:
    async with await connect_redis(data_dir=tmp_path) as owner:
        async with await connect_redis(data_dir=tmp_path) as attached:
            assert attached.embedded is None and attached.url == owner.url
            await attached.client.set("k", "v")
        assert await owner.client.get("k") == b"v"  # closing the attached handle left the server running
        with pytest.raises(QueueError, match="already running"):
            EmbeddedRedis(tmp_path).start()
    assert not (tmp_path / "redis.url").exists()


def test_long_directory_gets_a_short_socket(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    with EmbeddedRedis(deep) as server:
        assert len(str(server.socket_path)) <= 100 and server.socket_path.exists()
        assert (deep / "redis.url").read_text().strip() == server.url
    assert not server.socket_path.exists()


async def test_producer_rides_out_a_server_restart(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path).start()
    try:
        async with await connect_redis(url=server.url) as handle:
            q = TrajectoryQueue(handle.client, "s", consumer="c",
                                retry=RetryPolicy(attempts=200, base_delay_s=0.01, max_delay_s=0.05))
            await q.put([make_trajectory()])
            server.stop()
            t = make_trajectory(version=1)
            put = asyncio.create_task(q.put([t]))
            await asyncio.sleep(0.3)
            assert not put.done()
            server.start()
            await asyncio.wait_for(put, 30)
            assert [e.trajectory.weight_versions.tolist() for e in await q.read(5, timeout_s=1)][-1] == t.weight_versions.tolist()
    finally:
        server.stop()


async def test_url_and_env_select_an_external_server(system_redis_url: str, tmp_path: Path) -> None:
    async with await connect_redis(env={"AGENTRL_REDIS_URL": system_redis_url}, data_dir=tmp_path) as h:
        assert h.embedded is None and h.url == system_redis_url and h.version >= (7, 0, 0)
    assert not (tmp_path / "redis.conf").exists()  # no embedded server was started
    async with await connect_redis(url=system_redis_url, env={}) as h:
        assert await h.client.ping()


async def test_nothing_to_connect_to_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="AGENTRL_REDIS_URL"):
        await connect_redis(env={})


@pytest.mark.parametrize("url", ["unix:///nonexistent/agentrl/redis.sock", "tcp"])
async def test_unreachable_redis_is_a_clear_error(url: str) -> None:
    if url == "tcp":
        url = f"redis://:secret@127.0.0.1:{free_port()}/0"  # nothing listens there
    with pytest.raises(QueueError, match="cannot reach Redis") as err:
        await connect_redis(url=url, env={}, timeout_s=2)
    assert "secret" not in str(err.value)
    assert "6.2" in str(err.value)


class FakeInfo:
    def __init__(self, version: str) -> None:
        self.version = version

    async def info(self, section: str) -> dict[str, Any]:
        return {"redis_version": self.version}


@pytest.mark.parametrize("version", ["5.0.14", "6.0.16", "6.1.9"])
async def test_too_old_redis_is_refused(version: str) -> None:
    with pytest.raises(QueueError, match=rf"version {version}; agentrl needs >= 6.2"):
        await verify_server(FakeInfo(version), "redis://old:6379")


@pytest.mark.parametrize("version, parsed", [("6.2.0", (6, 2, 0)), ("7.0.15", (7, 0, 15)), ("7.2", (7, 2, 0))])
def test_new_enough_versions_parse(version: str, parsed: tuple[int, int, int]) -> None:
    assert check_redis_version({"redis_version": version}) == parsed


def test_unparseable_version_is_refused() -> None:
    with pytest.raises(QueueError, match="expected a version like"):
        check_redis_version({"redis_version": "banana"})


def test_redact_url_hides_password() -> None:
    assert redact_url("redis://user:pw@host:1/0") == "redis://user:***@host:1/0"
    assert redact_url("unix:///tmp/x.sock") == "unix:///tmp/x.sock"
