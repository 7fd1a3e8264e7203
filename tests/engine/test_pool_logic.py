"""EnginePool logic with fake servers: sticky routing, least-busy placement, fan-out, crash → take out →
restart → resync to the CURRENT weights → back in rotation, waiting when no server is up, giving up for good."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from agentrl.engine.base import EngineFinish, EngineUnavailable, GenerateResult, SamplingParams
from agentrl.engine.pool import EnginePool, MemberState, PoolConfig
from agentrl.engine.weight_sync import FromDisk
from agentrl.errors import EngineError

FAST = PoolConfig(health_interval_s=0.02, health_timeout_s=0.1, failures_to_down=2, wait_for_server_s=5.0,
                  hung_after_s=0.1,
                  restart_backoff_s=0.01)


@dataclass
class FakeServer:
    url: str
    up: bool = True
    restarts: int = 0
    fail_restarts: int = 0  # the next n restarts fail
    restart_s: float = 0.2  # runs in a worker thread, as SGLangServer.restart does
    clients: dict = field(default_factory=dict)

    cpu: float | None = None  # CPU time of its processes (None: unknown); a test advances it to look busy

    def alive(self) -> bool:
        return self.up

    def cpu_seconds(self) -> float | None:
        return self.cpu

    def restart(self) -> None:
        time.sleep(self.restart_s)
        self.restarts += 1
        if self.fail_restarts:
            self.fail_restarts -= 1
            raise EngineError(f"{self.url} did not start")
        self.up = True
        client = self.clients.get(self.url)
        if client is not None:
            client.reset()

    def stop(self, timeout_s: float = 0) -> None:
        self.up = False


class FakeClient:
    def __init__(self, url: str, servers: dict[str, FakeServer]) -> None:
        self.url = url
        self.server = servers.get(url)
        self.calls: list[tuple] = []
        self.hold: asyncio.Event | None = None
        self.healthy = True
        self.fail_updates = False  # the server refuses the weights (HTTP 400)
        self.die_on_update = False  # the server process dies while loading (once)
        self.reset()

    def reset(self) -> None:  # a fresh process: base weights, version 0, not paused
        self.version = 0
        self.paused = None
        self.path = None

    def _alive(self) -> bool:
        return self.server is None or self.server.up

    async def generate(self, ids: Sequence[int], sampling: SamplingParams, *, sticky_key=None) -> GenerateResult:
        self.calls.append(("generate", tuple(ids)))
        if self.hold is not None:
            await self.hold.wait()
        if not self._alive():
            raise EngineUnavailable(f"{self.url}: the server dropped the connection")
        return GenerateResult([7], [-0.5], [self.version], EngineFinish.STOP)

    async def prefill(self, ids: Sequence[int], *, sticky_key=None) -> None:
        self.calls.append(("prefill", tuple(ids)))
        if not self._alive():
            raise EngineUnavailable(f"{self.url}: the server dropped the connection")

    async def update_weights(self, path: str, version: int) -> None:
        self.calls.append(("update_weights", path, version))
        if self.die_on_update and self.server is not None:
            self.die_on_update, self.server.up = False, False
        if not self._alive():
            raise EngineUnavailable(f"{self.url}: the server dropped the connection")
        if self.fail_updates:
            raise EngineError(f"POST {self.url}/update_weights_from_disk failed with HTTP 400: no such path")
        self.path, self.version = path, version

    async def set_weight_version(self, version: int) -> None:
        self.calls.append(("set_weight_version", version))
        self.version = version

    async def weight_version(self) -> int:
        return self.version

    async def pause(self, mode="abort") -> None:
        self.calls.append(("pause", mode))
        self.paused = mode

    async def resume(self) -> None:
        self.calls.append(("resume",))
        self.paused = None

    async def abort_all(self) -> None: ...

    async def health(self, timeout_s=None) -> bool:
        return self.healthy and self._alive()

    async def probe(self, timeout_s=None) -> str:
        return "unreachable" if not self._alive() else "ok" if self.healthy else "unresponsive"

    async def aclose(self) -> None: ...


def make_pool(n: int = 2, *, managed: bool = True, config: PoolConfig = FAST):
    servers = {f"http://s{i}": FakeServer(f"http://s{i}") for i in range(n)}
    clients: dict[str, FakeClient] = {}

    def factory(url: str) -> FakeClient:
        clients[url] = FakeClient(url, servers if managed else {})
        if managed:
            servers[url].clients = clients
        return clients[url]

    members = list(servers.values()) if managed else list(servers)
    return EnginePool(members, config=config, client_factory=factory), servers, clients


async def wait_until(predicate, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


SP = SamplingParams(max_new_tokens=1)


async def test_sticky_keys_stay_on_one_server_and_new_keys_go_to_the_least_busy():
    pool, _, clients = make_pool(2)
    for c in clients.values():
        c.hold = asyncio.Event()
    held = [asyncio.create_task(pool.generate([i], SP, sticky_key=f"k{i}")) for i in range(4)]
    await wait_until(lambda: sum(len(c.calls) for c in clients.values()) == 4)
    assert sorted(len(c.calls) for c in clients.values()) == [2, 2]  # spread while all four are in flight
    for c in clients.values():
        c.hold.set()
    await asyncio.gather(*held)
    for i in range(4):
        home = pool.route_of(f"k{i}")
        for _ in range(3):  # later turns of the same episode: same server, whatever the load
            await pool.generate([i, 99], SP, sticky_key=f"k{i}")
        assert sum(1 for call in clients[home].calls if call[1][0] == i) == 4
    await pool.aclose()


async def test_a_prefill_goes_where_its_keys_generate_calls_go():
    pool, servers, clients = make_pool(3)
    await pool.prefill([5, 6], sticky_key="group-1")
    home = pool.route_of("group-1")
    assert home is not None and clients[home].calls == [("prefill", (5, 6))]
    for _ in range(3):  # the group's samples, whatever the load
        await pool.generate([5, 6], SP, sticky_key="group-1")
    assert [c[0] for c in clients[home].calls] == ["prefill", "generate", "generate", "generate"]
    servers[home].up = False  # the server died: the pool hears it from the prefill too
    with pytest.raises(EngineUnavailable):
        await pool.prefill([5, 6], sticky_key="group-1")
    await pool.aclose()


async def test_weights_pause_and_versions_fan_out_to_every_server():
    pool, _, clients = make_pool(3)
    await pool.pause("retract")
    await pool.update_weights("/w/v1", 1)
    await pool.resume()
    assert all(c.calls == [("pause", "retract"), ("update_weights", "/w/v1", 1), ("resume",)]
               for c in clients.values())
    assert await pool.weight_version() == 1
    await pool.aclose()


async def test_a_crashed_server_is_restarted_with_the_current_weights_and_rejoins():
    pool, servers, clients = make_pool(2)
    pool.start()
    await pool.update_weights("/w/v3", 3)
    clients["http://s0"].hold = asyncio.Event()
    in_flight = asyncio.create_task(pool.generate([1], SP, sticky_key="episode"))
    await wait_until(lambda: ("generate", (1,)) in clients["http://s0"].calls)  # held there
    assert pool.route_of("episode") == "http://s0"
    servers["http://s0"].up = False  # the process dies under the request
    clients["http://s0"].hold.set()
    with pytest.raises(EngineError):  # the episode fails; the scheduler retries its group
        await in_flight
    await wait_until(lambda: servers["http://s0"].restarts == 1 and pool.stats()[0].state == "up")
    assert clients["http://s0"].path == "/w/v3" and clients["http://s0"].version == 3
    assert await pool.weight_version() == 3
    await pool.aclose()


async def test_updates_during_a_restart_are_not_missed():
    pool, servers, clients = make_pool(2)
    pool.start()
    await pool.update_weights("/w/v1", 1)
    servers["http://s1"].up = False
    await wait_until(lambda: pool.stats()[1].state == "restarting")
    await pool.update_weights("/w/v2", 2)  # s1 is out: it must come back with v2, not v1
    await wait_until(lambda: pool.stats()[1].state == "up")
    assert clients["http://s1"].version == 2
    await pool.aclose()


async def test_generate_waits_for_a_restarting_server_instead_of_failing():
    pool, servers, _ = make_pool(1)
    pool.start()
    servers["http://s0"].up = False
    servers["http://s0"].fail_restarts = 1  # the first restart fails; the second works
    await wait_until(lambda: pool.stats()[0].state != "up")
    out = await pool.generate([1], SP, sticky_key="k")
    assert out.output_ids == [7] and servers["http://s0"].restarts == 2
    await pool.aclose()


async def test_a_server_that_cannot_restart_is_out_for_good():
    pool, servers, _ = make_pool(1, config=PoolConfig(health_interval_s=0.02, max_restarts=2,
                                                      wait_for_server_s=30.0, restart_backoff_s=0.01))
    pool.start()
    servers["http://s0"].up = False
    servers["http://s0"].fail_restarts = 99
    await wait_until(lambda: pool.stats()[0].state == MemberState.FAILED.value, timeout=20)
    with pytest.raises(EngineError, match="no SGLang server is up"):
        await asyncio.wait_for(pool.generate([1], SP), 5)  # fails at once, not after 30 s
    await pool.aclose()


async def test_a_server_that_rejoins_while_the_pool_is_paused_is_paused_too():
    pool, servers, clients = make_pool(2)
    pool.start()
    await pool.pause("in_place")
    servers["http://s1"].up = False
    await wait_until(lambda: servers["http://s1"].restarts == 1 and pool.stats()[1].state == "up")
    assert clients["http://s1"].paused == "in_place"
    await pool.resume()
    assert clients["http://s1"].paused is None
    await pool.aclose()


async def test_a_server_that_dies_while_loading_comes_back_with_the_new_weights():
    pool, servers, clients = make_pool(2)
    pool.start()
    clients["http://s0"].die_on_update = True
    await pool.update_weights("/w/v1", 1)  # no error: s0 is taken out and restarted with v1
    await wait_until(lambda: servers["http://s0"].restarts == 1 and pool.stats()[0].state == "up")
    assert clients["http://s0"].version == clients["http://s1"].version == 1
    await pool.aclose()


async def test_a_server_restarted_after_a_retarget_loads_from_the_new_source():
    """Once the trainer that broadcast the weights has ended, the pool is retargeted to the same version on disk:
    nothing is loaded then, and a server restarted afterwards loads from there, not from the old source."""

    class Counting:
        def __init__(self, source: FromDisk) -> None:
            self.source, self.version, self.loads = source, source.version, 0

        async def load(self, clients):  # type: ignore[no-untyped-def]
            self.loads += 1
            return await self.source.load(clients)

    pool, servers, clients = make_pool(2)
    pool.start()
    await pool.update_weights("/w/broadcast", 3)
    final = Counting(FromDisk("/w/final", 3))
    await pool.retarget(final)
    assert final.loads == 0 and all(c.path == "/w/broadcast" for c in clients.values())
    servers["http://s1"].up = False
    await wait_until(lambda: servers["http://s1"].restarts == 1 and pool.stats()[1].state == "up")
    assert final.loads == 1
    assert (clients["http://s1"].path, clients["http://s1"].version) == ("/w/final", 3)
    assert clients["http://s0"].path == "/w/broadcast"  # the server that stayed up loads nothing
    assert await pool.weight_version() == 3
    await pool.aclose()


async def test_weights_the_servers_refuse_are_an_error_and_the_servers_stay_in():
    pool, servers, clients = make_pool(2)
    for c in clients.values():
        c.fail_updates = True
    with pytest.raises(EngineError, match="failed on 2 of 2 servers: http://s0: .*HTTP 400"):
        await pool.update_weights("/no/such/path", 1)
    assert [m.state for m in pool.stats()] == ["up", "up"] and not any(s.restarts for s in servers.values())
    await pool.aclose()


async def test_unmanaged_server_comes_back_when_it_answers_and_is_resynced():
    pool, _, clients = make_pool(2, managed=False)
    pool.start()
    await pool.set_weight_version(4)
    clients["http://s0"].healthy = False
    await wait_until(lambda: pool.stats()[0].state == "down")
    clients["http://s0"].reset()  # someone restarted it by hand: version 0
    clients["http://s0"].healthy = True
    await wait_until(lambda: pool.stats()[0].state == "up")
    assert clients["http://s0"].version == 4
    await pool.aclose()


async def _until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def test_a_server_that_stops_answering_health_but_keeps_computing_is_slow_not_dead() -> None:
    config = PoolConfig(health_interval_s=0.02, health_timeout_s=0.1, failures_to_down=2, hung_after_s=0.4,
                        max_unhealthy_s=60.0, restart_backoff_s=0.01)
    pool, servers, clients = make_pool(1, config=config)
    server, client = servers["http://s0"], clients["http://s0"]
    server.cpu = 0.0
    async with pool:
        client.healthy = False  # a starved machine: SGLang answers 503 while it still decodes
        for _ in range(60):  # 1.2 s, three times hung_after_s, with its CPU time growing
            server.cpu += 0.1
            await asyncio.sleep(0.02)
        assert pool.stats()[0].state == MemberState.UP.value and server.restarts == 0
        t0 = time.monotonic()  # now it stops computing too: hung
        await _until(lambda: server.restarts == 1)
        assert server.restarts == 1 and time.monotonic() - t0 >= 0.3


async def test_a_server_busy_for_longer_than_max_unhealthy_is_taken_out_anyway() -> None:
    config = PoolConfig(health_interval_s=0.02, health_timeout_s=0.1, failures_to_down=2, hung_after_s=60.0,
                        max_unhealthy_s=0.3, restart_backoff_s=0.01)
    pool, servers, clients = make_pool(1, config=config)
    server, client = servers["http://s0"], clients["http://s0"]
    server.cpu = 0.0
    async with pool:
        client.healthy = False
        t0 = time.monotonic()
        while server.restarts == 0 and time.monotonic() - t0 < 5:
            server.cpu += 0.1
            await asyncio.sleep(0.02)
        assert server.restarts == 1 and time.monotonic() - t0 >= 0.25


async def test_a_server_nobody_listens_on_is_taken_out_without_waiting_for_the_hung_deadline() -> None:
    config = PoolConfig(health_interval_s=0.02, health_timeout_s=0.1, failures_to_down=2, hung_after_s=60.0,
                        restart_backoff_s=0.01)
    pool, servers, clients = make_pool(2, managed=False, config=config)
    async with pool:
        pool._members[0].client.server = FakeServer("http://s0", up=False)  # connection refused from now on
        await _until(lambda: pool.stats()[0].state == MemberState.DOWN.value, 2.0)
        assert pool.stats()[0].state == MemberState.DOWN.value and pool.stats()[1].state == MemberState.UP.value


async def test_attaching_clears_a_pause_an_earlier_owner_left_on_servers_it_did_not_start():
    pool, _, clients = make_pool(2, managed=False)
    for c in clients.values():
        c.paused = "in_place"  # an earlier rollout process paused them and was killed before resuming
    pool.start()
    await wait_until(lambda: all(c.paused is None for c in clients.values()))
    assert all(c.calls.count(("resume",)) == 1 for c in clients.values())
    await pool.aclose()


async def test_attaching_leaves_started_servers_and_the_pools_own_pause_alone():
    managed, _, managed_clients = make_pool(1)
    async with managed:
        await asyncio.sleep(0.1)  # a few health ticks
    assert ("resume",) not in managed_clients["http://s0"].calls  # a process agentrl started is fresh

    pool, _, clients = make_pool(1, managed=False)
    await pool.pause("retract")  # the pool's own pause, before its health loop starts, is not undone
    pool.start()
    await asyncio.sleep(0.1)
    assert clients["http://s0"].paused == "retract" and ("resume",) not in clients["http://s0"].calls
    await pool.aclose()
