"""The rollout side of ``weight_sync: distributed`` with fake servers (agentrl.engine.weight_sync): the order of the
calls on every server, a fresh group per attempt, the fallback to disk, servers stuck in a collective reported for
a restart, and the pool bringing a restarted server to the current weights through the same broadcast; the
``tensor`` source's calls, an offer from another host refused, its fallback. The real server is in
test_weight_sync_sglang.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from test_pool_logic import FAST, make_pool

from agentrl.engine.base import EngineTimeout
from agentrl.engine.pool import MemberState
from agentrl.engine.weight_sync import Broadcast, Tensors
from agentrl.errors import EngineError
from agentrl.weight_sync import BucketMeta, TensorOffer, WeightOffer, WeightSyncError, host_id

BUCKETS = (BucketMeta(("a",), "float32", ((2,),)), BucketMeta(("b", "c"), "bfloat16", ((3,), (1, 2))))


class Server:
    """A fake server: records the weight-sync calls; ``fail`` maps a call name to the exception it raises."""

    def __init__(self, url: str, log: list[tuple[Any, ...]]) -> None:
        self.url, self.log = url, log
        self.fail: dict[str, BaseException] = {}
        self.version = 0
        self.paused = None

    async def _do(self, *call: Any) -> None:
        self.log.append((self.url, *call))
        if call[0] in self.fail:
            raise self.fail[call[0]]

    async def begin_weight_update(self, **_: Any) -> None:
        await self._do("begin")

    async def init_weight_group(self, **kw: Any) -> None:
        await self._do("init", kw["rank"], kw["world_size"], kw["group"])

    async def receive_weight_bucket(self, **kw: Any) -> None:
        await self._do("bucket", tuple(kw["names"]), kw["version"])
        if kw["version"] is not None:
            self.version = kw["version"]

    async def end_weight_update(self, **_: Any) -> None:
        await self._do("end")

    async def destroy_weight_group(self, group: str, **_: Any) -> None:
        await self._do("destroy", group)

    async def update_weights(self, path: str, version: int) -> None:
        await self._do("disk", path, version)
        self.version = version

    async def load_weight_tensors(self, payload: str, *, version: int, timeout_s: float) -> None:
        await self._do("tensor", payload, version, timeout_s)
        self.version = version


class Trainer:
    def __init__(self, version: int = 3) -> None:
        self.version, self.offers, self.refuse = version, 0, False

    async def offer(self, world_size: int) -> WeightOffer:
        if self.refuse:
            raise WeightSyncError("the trainer did not answer")
        self.offers += 1
        return WeightOffer(version=self.version, address="10.0.0.1", port=9000 + self.offers,
                           group=f"g{self.offers}", world_size=world_size, backend="gloo", timeout_s=5.0,
                           buckets=BUCKETS)


async def test_every_server_joins_receives_each_bucket_in_order_and_the_last_carries_the_version() -> None:
    log: list[tuple[Any, ...]] = []
    servers = [Server("s0", log), Server("s1", log)]
    source = Broadcast(2, Trainer(version=3).offer)
    assert await source.load(servers) == [None, None]  # type: ignore[arg-type]
    assert source.version == 3  # the trainer sent its newest: the servers serve that
    for s, rank in zip(servers, (1, 2)):
        calls = [c[1:] for c in log if c[0] == s.url]
        assert calls == [("begin",), ("init", rank, 3, "g1"), ("bucket", ("a",), None), ("bucket", ("b", "c"), 3),
                         ("end",), ("destroy", "g1")]
        assert s.version == 3


async def test_a_refused_broadcast_is_retried_with_a_fresh_group_then_falls_back_to_the_exported_folder(
        tmp_path: Path) -> None:
    log: list[tuple[Any, ...]] = []
    server = Server("s0", log)
    server.fail["init"] = EngineError("s0 could not join weight group: peer never joined")
    trainer = Trainer(version=5)
    folder = tmp_path / "v5"
    folder.mkdir()
    (folder / "config.json").write_text("{}")

    async def export() -> tuple[str, int]:
        return str(folder), 5

    source = Broadcast(5, trainer.offer, export=export, attempts=2)
    assert await source.load([server]) == [None]  # type: ignore[list-item]
    assert trainer.offers == 2 and source.fell_back
    assert [c[1] for c in log].count("begin") == 2 and [c[1] for c in log].count("end") == 2  # each attempt ended
    assert log[-1] == ("s0", "disk", str(folder), 5) and server.version == 5


async def test_without_a_shared_filesystem_the_fallback_says_so() -> None:
    server = Server("s0", [])
    server.fail["bucket"] = EngineError("s0 could not receive weights: size mismatch")

    async def export() -> tuple[str, int]:
        return "/trainer-node/runs/r/weights/v5", 5

    [outcome] = await Broadcast(5, Trainer(version=5).offer, export=export, attempts=1).load([server])  # type: ignore[list-item]
    assert isinstance(outcome, EngineError) and "not readable here (no filesystem shared" in str(outcome)


async def test_a_trainer_that_does_not_answer_ends_the_opened_sessions() -> None:
    log: list[tuple[Any, ...]] = []
    trainer = Trainer()
    trainer.refuse = True
    [outcome] = await Broadcast(3, trainer.offer, attempts=1).load([Server("s0", log)])  # type: ignore[list-item]
    assert isinstance(outcome, EngineError) and "did not answer" in str(outcome)
    assert [c[1] for c in log] == ["begin", "end"]


async def test_a_server_stuck_in_a_collective_is_not_retried_and_the_others_leave_the_group() -> None:
    log: list[tuple[Any, ...]] = []
    servers = [Server("s0", log), Server("s1", log)]
    servers[1].fail["bucket"] = EngineTimeout("s1: receive weights timed out after 35s")
    trainer = Trainer()
    outcome = await Broadcast(3, trainer.offer, attempts=3).load(servers)  # type: ignore[arg-type]
    assert outcome[0] is None and isinstance(outcome[1], EngineTimeout)
    assert trainer.offers == 1  # a restart, not a retry, is what a stuck server needs
    s0 = [c[1] for c in log if c[0] == "s0"]
    s1 = [c[1] for c in log if c[0] == "s1"]
    assert s0[-2:] == ["end", "destroy"] and "end" not in s1  # nothing more is sent to the stuck one


async def test_the_pool_restarts_a_stuck_server_and_brings_it_back_by_broadcast() -> None:
    pool, servers, clients = make_pool(2, config=FAST)
    log: list[tuple[Any, ...]] = []
    for url, c in clients.items():  # the fake pool clients gain the weight-sync calls of Server
        shim = Server(url, log)
        for name in ("begin_weight_update", "init_weight_group", "receive_weight_bucket", "end_weight_update",
                     "destroy_weight_group"):
            setattr(c, name, getattr(shim, name))
        c.shim = shim
    stuck = clients["http://s1"]
    stuck.shim.fail["bucket"] = EngineTimeout("http://s1: receive weights timed out")
    trainer = Trainer(version=4)
    async with pool:
        served = await pool.load_weights(Broadcast(4, trainer.offer))
        assert served == 4
        assert dict((m.url, m.state) for m in pool.stats())["http://s1"] in (MemberState.DOWN.value,
                                                                            MemberState.RESTARTING.value)
        stuck.shim.fail.clear()  # the restarted process is healthy
        for _ in range(200):
            if all(m.state == MemberState.UP.value for m in pool.stats()):
                break
            await asyncio.sleep(0.02)
        assert all(m.state == MemberState.UP.value for m in pool.stats())
    assert servers["http://s1"].restarts == 1
    rejoin = [c for c in log if c[0] == "http://s1" and c[1] == "init"][-1]
    assert rejoin[2:4] == (1, 2)  # a group of the trainer and the restarted server alone
    assert stuck.shim.version == 4


def tensor_trainer(version: int, host: str | None = None) -> tuple[list[int], Any]:
    asked: list[int] = []

    async def offer(servers: int) -> TensorOffer:
        asked.append(servers)
        return TensorOffer(version=version, host=host or host_id(), payloads=tuple(f"p{i}" for i in range(servers)))

    return asked, offer


async def test_each_server_loads_its_own_tensor_payload_inside_a_session_and_serves_the_offered_version() -> None:
    log: list[tuple[Any, ...]] = []
    servers = [Server("s0", log), Server("s1", log)]
    asked, offer = tensor_trainer(version=6)
    source = Tensors(5, offer, timeout_s=20.0, margin_s=5.0)
    assert await source.load(servers) == [None, None]  # type: ignore[arg-type]
    assert asked == [2] and source.version == 6
    for i, s in enumerate(servers):
        assert [c[1:] for c in log if c[0] == s.url] == [("begin",), ("tensor", f"p{i}", 6, 25.0), ("end",)]
        assert s.version == 6


async def test_a_tensor_offer_from_another_host_is_refused_unread_then_the_update_falls_back_to_disk(
        tmp_path: Path) -> None:
    log: list[tuple[Any, ...]] = []
    server = Server("s0", log)
    asked, offer = tensor_trainer(version=5, host="trainer-node/other-boot")
    folder = tmp_path / "v5"
    folder.mkdir()
    (folder / "config.json").write_text("{}")

    async def export() -> tuple[str, int]:
        return str(folder), 5

    [outcome] = await Tensors(5, offer, attempts=1).load([server])  # type: ignore[list-item]
    assert isinstance(outcome, EngineError) and "needs the trainer on the servers' host" in str(outcome)
    assert "trainer-node/other-boot" in str(outcome) and [c[1] for c in log] == ["begin", "end"]

    source = Tensors(5, offer, export=export, attempts=2)
    assert await source.load([server]) == [None]  # type: ignore[list-item]
    assert source.fell_back and len(asked) == 3 and "tensor" not in [c[1] for c in log]
    assert log[-1] == ("s0", "disk", str(folder), 5) and server.version == 5


async def test_a_server_stuck_loading_tensors_is_reported_for_a_restart_not_retried() -> None:
    log: list[tuple[Any, ...]] = []
    servers = [Server("s0", log), Server("s1", log)]
    servers[1].fail["tensor"] = EngineTimeout("s1: load weights timed out after 150s")
    asked, offer = tensor_trainer(version=3)
    outcome = await Tensors(3, offer, attempts=3).load(servers)  # type: ignore[arg-type]
    assert outcome[0] is None and isinstance(outcome[1], EngineTimeout)
    assert asked == [2]
    assert [c[1] for c in log if c[0] == "s1"] == ["begin", "tensor"]  # nothing more is sent to the stuck one
