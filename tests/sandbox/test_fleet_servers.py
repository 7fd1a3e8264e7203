"""A SandboxFleet over two real ``agentrl sandbox serve --backend local`` processes on free ports: runs spread over
both; one killed, runs still succeed on the other; restarted, it is put back; a session stays on its server; both
down, a run is an infrastructure error (a reward's INFRA_ERROR, never a score of 0)."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from agentrl.rewards import CodeTestsReward, RewardInput, RewardStatus
from agentrl.sandbox import SandboxConfig, SandboxFleet
from agentrl.sandbox.base import Limits, RequestStatus, RunRequest
from agentrl.sandbox.schemas import ServerLoad
from agentrl.types import Task

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "fleet-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """One ``agentrl sandbox serve --backend local`` process (its own process group) on a fixed port."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"serve-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> Served:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "AGENTRL_SANDBOX_TOKEN": TOKEN}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agentrl.cli", "sandbox", "serve", "--backend", "local", "--port",
                 str(self.port), "--max-concurrency", "2", "--max-queue", "64"],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        async with asyncio.timeout(120), aiohttp.ClientSession() as http:
            while True:
                assert self.proc.poll() is None, self.log.read_text()[-3000:]
                try:
                    async with http.get(self.url + "/v1/ping", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            return self
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.2)

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[Served]]:
    pair = [Served(tmp_path), Served(tmp_path)]
    try:
        yield pair
    finally:
        for s in pair:
            s.kill()


@pytest.fixture
async def started(servers: list[Served]) -> AsyncIterator[list[Served]]:
    await asyncio.gather(*(s.start() for s in servers))
    yield servers


async def until(cond: object, what: str, timeout_s: float = 30.0) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not cond():  # type: ignore[operator]
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"waited {timeout_s:g}s for {what}") from None


SLOW = RunRequest(code="import time\ntime.sleep(0.3)\nprint('ok')", limits=Limits(time_s=10))


async def test_servers_report_their_load(started: list[Served]) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(started[0].url + "/v1/ping") as r:
            assert await r.json() == "pong"
            assert ServerLoad.from_headers(r.headers) == ServerLoad(0, 0, 2, 0)
        async with http.get(started[0].url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            text = await r.text()
        assert "agentrl_sandbox_capacity 2.0" in text and "agentrl_sandbox_running 0.0" in text


async def test_a_fleet_of_two_real_servers(started: list[Served]) -> None:
    a, b = started
    config = SandboxConfig(backend="remote", url=f"{a.url},{b.url}", options={"token": TOKEN},
                           fleet={"health_interval_s": 0.2, "health_timeout_s": 2.0, "failures_to_down": 1})
    fleet = config.build()
    assert isinstance(fleet, SandboxFleet)
    async with fleet:
        results = await asyncio.gather(*(fleet.run(SLOW) for _ in range(8)))
        assert [r.stdout for r in results] == ["ok\n"] * 8, results
        assert [s.requests for s in fleet.stats()] == [4, 4]  # 2 slots each: least in flight alternates
        assert all(s.reported is not None and s.reported.capacity == 2 for s in fleet.stats())

        session = await fleet.session("python", Limits(time_s=5))
        assert (await session.run("x = 41")).status is RequestStatus.SUCCESS
        assert (await session.run("print(x + 1)")).stdout == "42\n"
        home, other = (a, b) if session.url == a.url else (b, a)

        home.kill()  # the session's server dies: runs still succeed, on the other one
        before = {s.url: s.requests for s in fleet.stats()}
        results = await asyncio.gather(*(fleet.run(SLOW) for _ in range(6)))
        assert [r.stdout for r in results] == ["ok\n"] * 6, results
        stats = {s.url: s for s in fleet.stats()}
        assert not stats[home.url].up and stats[other.url].requests - before[other.url] == 6
        r = await session.run("print(x)")  # pinned: not moved to the other server, where x does not exist
        assert r.is_sandbox_error, r

        await home.start()  # restarted on the same port: its /v1/ping puts it back
        await until(lambda: all(s.up for s in fleet.stats()), "the restarted server to be put back")
        before = {s.url: s.requests for s in fleet.stats()}
        await asyncio.gather(*(fleet.run(SLOW) for _ in range(4)))
        assert all(s.requests > before[s.url] for s in fleet.stats()), fleet.stats()

        a.kill()
        b.kill()
        r = await fleet.run(SLOW)
        assert (r.status, r.run_status) == (RequestStatus.SANDBOX_ERROR, None)
        assert "no sandbox server can take the run" in r.message, r.message
        task = Task(id="sum", prompt="Add.", metadata={"tests": [{"stdin": "2 3\n", "expected_stdout": "5\n"}]})
        result = await CodeTestsReward(fleet)(task, RewardInput(text="```python\nprint(5)\n```"))
        assert result.status is RewardStatus.INFRA_ERROR and math.isnan(result.score), result
        await session.aclose()


async def test_cli_runs_a_program_on_a_fleet(started: list[Served], tmp_path: Path) -> None:
    program = tmp_path / "prog.py"
    program.write_text("print('from the fleet')")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AGENTRL_SANDBOX_TOKEN": TOKEN}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentrl.cli", "sandbox", "run", str(program), "--backend", "remote", "--url",
        ",".join(s.url for s in started), cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert (proc.returncode, out) == (0, b"from the fleet\n"), err.decode()[-2000:]
