"""SandboxFleet's logic over fake servers: least-load selection, a run moved off a server that did not run it, health
checks taking a server out and putting it back, pinned sessions, and no server left = an infrastructure error.
(tests/sandbox/test_fleet_servers.py drives real ``agentrl sandbox serve`` processes.)"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agentrl.errors import ConfigError, SandboxError
from agentrl.rewards import CodeTestsReward, RewardInput, RewardStatus
from agentrl.sandbox.base import Limits, RequestStatus, RunRequest, RunResult, RunStatus
from agentrl.sandbox.config import FleetConfig
from agentrl.sandbox.fleet import SandboxFleet
from agentrl.sandbox.remote import ServerUnavailable
from agentrl.sandbox.schemas import ServerLoad
from agentrl.types import Task

REQUEST = RunRequest(code="print(1)")


class FakeSession:
    def __init__(self, server: FakeServer) -> None:
        self.server, self.cells, self.closed = server, [], False

    async def run(self, code: str, *, time_s: float | None = None) -> RunResult:
        self.cells.append(code)
        if self.server.fail is not None:
            return RunResult(RequestStatus.SANDBOX_ERROR, None, message=f"{self.server.url} is gone")
        return RunResult(RequestStatus.SUCCESS, RunStatus.FINISHED, 0, stdout=self.server.url)

    async def aclose(self) -> None:
        self.closed = True


class FakeServer:
    """Stands for a RemoteSandbox: ``fail`` is raised by runs and session opens, ``hold`` (while set) keeps runs
    in flight, ``ping_ok`` and ``reported`` are what its /v1/ping says."""

    def __init__(self, url: str, **opts: Any) -> None:
        self.url, self.opts = url, opts
        self.runs = 0
        self.fail: Exception | None = None
        self.hold: asyncio.Event | None = None
        self.ping_ok, self.reported = True, None
        self.sessions: list[FakeSession] = []

    async def run_or_raise(self, request: RunRequest) -> RunResult:
        self.runs += 1
        if self.fail is not None:
            raise self.fail
        if self.hold is not None:
            await self.hold.wait()
        return RunResult(RequestStatus.SUCCESS, RunStatus.FINISHED, 0, stdout=self.url)

    async def session(self, language: str = "python", limits: Limits | None = None) -> FakeSession:
        if self.fail is not None:
            raise self.fail
        self.sessions.append(FakeSession(self))
        return self.sessions[-1]

    async def load(self, timeout_s: float | None = None) -> ServerLoad | None:
        if not self.ping_ok:
            raise ServerUnavailable(f"GET {self.url}/v1/ping failed: refused")
        return self.reported

    async def aclose(self) -> None:
        pass


def fakes(fleet: SandboxFleet) -> list[FakeServer]:
    return [s.client for s in fleet._servers]  # type: ignore[misc]


@pytest.fixture
async def fleet() -> AsyncIterator[SandboxFleet]:
    f = SandboxFleet(["http://a:1", "http://b:1"], client_factory=FakeServer,  # type: ignore[arg-type]
                     fleet=FleetConfig(health_interval_s=0.01, failures_to_down=2))
    yield f
    await f.aclose()


async def until(cond: Any, what: str, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.005)


async def started(fleet: SandboxFleet, n: int) -> list[asyncio.Task[RunResult]]:
    tasks = [asyncio.ensure_future(fleet.run(REQUEST)) for _ in range(n)]
    await until(lambda: sum(s.inflight for s in fleet._servers) == n, f"{n} runs in flight")
    return tasks


async def test_each_server_gets_its_own_client_with_one_retry() -> None:
    f = SandboxFleet(["http://a:1/", "http://b:1"], client_factory=FakeServer, token="t")  # type: ignore[arg-type]
    assert [c.opts for c in fakes(f)] == [{"token": "t", "retries": 1}] * 2
    with pytest.raises(ConfigError, match="listed twice"):
        SandboxFleet(["http://a:1/", "http://a:1"], client_factory=FakeServer)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="expected a sandbox server's URL"):
        SandboxFleet(["a:1"], client_factory=FakeServer)  # type: ignore[arg-type]


async def test_runs_go_to_the_server_with_the_fewest_in_flight(fleet: SandboxFleet) -> None:
    hold = asyncio.Event()
    for s in fakes(fleet):
        s.hold = hold
    tasks = await started(fleet, 6)
    assert [s.runs for s in fakes(fleet)] == [3, 3]
    hold.set()
    assert {r.stdout for r in await asyncio.gather(*tasks)} == {"http://a:1", "http://b:1"}


async def test_reported_load_and_capacity_steer_runs(fleet: SandboxFleet) -> None:
    a, b = fakes(fleet)
    a.reported = ServerLoad(running=4, queued=2, capacity=4)  # other clients fill it: (0 + 6) / 4 = 1.5
    b.reported = ServerLoad(running=0, queued=0, capacity=4)
    await fleet.start()
    hold = asyncio.Event()
    a.hold = b.hold = hold
    tasks = await started(fleet, 6)  # b's load reaches 6 / 4 = 1.5 only with the sixth
    assert (a.runs, b.runs) == (0, 6)
    hold.set()
    await asyncio.gather(*tasks)


async def test_a_server_that_did_not_run_it_is_taken_out_and_the_run_moves(fleet: SandboxFleet) -> None:
    a, b = fakes(fleet)
    a.fail, a.ping_ok = ServerUnavailable("connection refused"), False
    results = [await fleet.run(REQUEST) for _ in range(4)]
    assert [r.stdout for r in results] == ["http://b:1"] * 4
    assert a.runs == 1 and [s.up for s in fleet.stats()] == [False, True]
    a.fail, a.ping_ok = None, True  # it answers again: the health loop puts it back
    await until(lambda: fleet.stats()[0].up, "a back")
    hold = asyncio.Event()
    a.hold = b.hold = hold
    tasks = await started(fleet, 2)
    assert (a.runs, b.runs) == (2, 5)
    hold.set()
    await asyncio.gather(*tasks)


async def test_a_full_server_stays_in(fleet: SandboxFleet) -> None:
    a, b = fakes(fleet)
    a.fail = ServerUnavailable("the server answered 429", busy=True)
    assert (await fleet.run(REQUEST)).stdout == "http://b:1"
    assert a.runs == 1 and all(s.up for s in fleet.stats())


async def test_a_run_that_may_have_run_is_not_sent_again(fleet: SandboxFleet) -> None:
    for s in fakes(fleet):
        s.fail = SandboxError("POST /v1/run did not answer within 40s")
    r = await fleet.run(REQUEST)
    assert r.is_sandbox_error and "did not answer" in r.message
    assert sum(s.runs for s in fakes(fleet)) == 1 and all(s.up for s in fleet.stats())


async def test_no_server_left_is_an_infrastructure_error_never_a_zero(fleet: SandboxFleet) -> None:
    for s in fakes(fleet):
        s.fail, s.ping_ok = ServerUnavailable("connection refused"), False
    r = await fleet.run(REQUEST)
    assert (r.status, r.run_status) == (RequestStatus.SANDBOX_ERROR, None)
    assert "no sandbox server can take the run" in r.message and "http://a:1: down" in r.message
    with pytest.raises(SandboxError, match="no sandbox server can take a session"):
        await fleet.session()
    task = Task(id="sum", prompt="Add.", metadata={"tests": [{"stdin": "2 3\n", "expected_stdout": "5\n"}]})
    result = await CodeTestsReward(fleet)(task, RewardInput(text="```python\nprint(5)\n```"))
    assert result.status is RewardStatus.INFRA_ERROR and math.isnan(result.score), result
    assert "no sandbox server" in result.details["error"]


async def test_failed_pings_take_a_server_out_and_one_answer_puts_it_back() -> None:
    f = SandboxFleet(["http://a:1", "http://b:1"], client_factory=FakeServer,  # type: ignore[arg-type]
                     fleet=FleetConfig(health_interval_s=3600, failures_to_down=2))
    a, _ = fakes(f)
    try:
        a.ping_ok = False
        await f.start()
        assert f.stats()[0].up  # one failure is not enough
        await f._check(f._servers[0])
        assert not f.stats()[0].up
        assert [(await f.run(REQUEST)).stdout for _ in range(3)] == ["http://b:1"] * 3
        a.ping_ok = True
        await f._check(f._servers[0])
        assert f.stats()[0].up and f._servers[0].failures == 0
    finally:
        await f.aclose()


async def test_a_session_stays_on_its_server(fleet: SandboxFleet) -> None:
    a, b = fakes(fleet)
    s = await fleet.session()
    home = a if s.url == a.url else b
    other = b if home is a else a
    hold, other_hold = asyncio.Event(), asyncio.Event()
    home.hold, other.hold = hold, other_hold
    tasks = await started(fleet, 4)
    other_hold.set()  # the other server's runs end: its server is now the busier one
    await until(lambda: sum(s.inflight for s in fleet._servers) == 2, "the other server's runs to end")
    assert {s.url: s.inflight for s in fleet.stats()} == {home.url: 2, other.url: 0}
    for i in range(3):
        assert (await s.run(f"x = {i}")).stdout == home.url
    assert len(home.sessions[0].cells) == 3 and other.sessions == []
    home.fail = ServerUnavailable("connection refused")  # its server dies: the cell fails, it does not move
    r = await s.run("print(x)")
    assert r.is_sandbox_error and other.sessions == []
    hold.set()
    await asyncio.gather(*tasks)
    await s.aclose()
    assert home.sessions[0].closed
