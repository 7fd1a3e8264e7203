"""EnginePool against REAL SGLang servers: fan-out of control calls; sticky routing of multi-turn episodes; and
(slow) a server killed mid-rollout is taken out, restarted with the current weights and put back while the
rollout goes on (that server first finds its port taken while it starts, and starts again on another)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from agentrl.async_rollout import EpisodeBudget, EpisodeRunner, RolloutConfig, RolloutScheduler
from agentrl.engine import (
    EnginePool,
    PoolConfig,
    SamplingParams,
    SGLangClient,
    SGLangServer,
    SGLangServerConfig,
)
from agentrl.errors import EngineError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "async_rollout"))
from rollout_support import FifoTrainer, LetterTurnsEnv, SimRegistry, task_stream

pytestmark = pytest.mark.sglang


class RecordingClient(SGLangClient):
    """Remembers every input it was sent (to tell which server served which turn)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.inputs: list[tuple[int, ...]] = []

    async def generate(self, input_ids, sampling, *, sticky_key=None):
        self.inputs.append(tuple(input_ids))
        return await super().generate(input_ids, sampling, sticky_key=sticky_key)


async def test_control_calls_fan_out_and_generation_works(sglang_url, tiny_model_path):
    async with EnginePool([sglang_url]) as pool:
        before = await pool.weight_version()
        await pool.pause("retract")
        await pool.update_weights(str(tiny_model_path), before + 1)
        await pool.resume()
        assert await pool.weight_version() == before + 1
        await pool.set_weight_version(before + 2)
        out = await pool.generate([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True), sticky_key="k")
        assert len(out.output_ids) == 4 and set(out.weight_versions) == {before + 2}
        assert pool.route_of("k") == sglang_url


async def test_a_pool_attaching_to_a_server_an_earlier_owner_left_paused_resumes_it(sglang_url):
    # an owner (a rollout process killed between pause and resume) pauses the server and is gone
    async with SGLangClient(sglang_url) as owner:
        await owner.pause("in_place")
    try:
        async with EnginePool([sglang_url]) as pool:  # a new owner attaching, as a resumed run's rollout process
            async with asyncio.timeout(120):  # a hang guard, not a timing: paused, this request never returns
                out = await pool.generate([5, 6, 7], SamplingParams(max_new_tokens=2, ignore_eos=True))
            assert len(out.output_ids) == 2
            async with SGLangClient(sglang_url) as probe:
                assert await probe.health(30)  # /health generates a token: answers only when not paused
    finally:
        async with SGLangClient(sglang_url) as cleanup:
            await cleanup.resume()  # the session's server serves the next tests either way


def _servers_of(trajectory, clients: list[RecordingClient]) -> set[str]:
    """The servers that received the later turns of ``trajectory`` (a turn's request is the prefix before it;
    the first turn's is the bare prompt, which a retried group sends again, so it does not identify a server)."""
    urls: set[str] = set()
    for turn in trajectory.turns[1:]:
        prefix = tuple(trajectory.token_ids[: turn.token_start])
        urls |= {c.url for c in clients if prefix in c.inputs}
    return urls


@pytest.mark.slow
async def test_killed_server_is_restarted_with_current_weights_and_the_rollout_goes_on(
        sglang_url, tiny_model_path, chat_tokenizer, tmp_path, squatter):
    # SGLang's own layout (a detokenizer process; the session's server has agentrl's thread): both serve the rollout
    config = SGLangServerConfig(model_path=str(tiny_model_path), max_total_tokens=8192, dtype="float32",
                                detokenizer="process")
    spawns: list[int] = []

    def squat_the_first(server: SGLangServer) -> None:
        spawns.append(server.port)
        if len(spawns) == 1:  # another process takes the port while SGLang loads the model (it binds after)
            squatter.take(server.port)

    extra = SGLangServer(config, name="sglang-extra", log_path=tmp_path / "extra.log", on_spawn=squat_the_first)
    await asyncio.to_thread(extra.start)
    # SGLang could not bind it (uvicorn exits 3); the squatter's /health 200 was not taken for the server's: it
    # started again on another port
    assert spawns == [squatter.ports[0], extra.port] and extra.port != squatter.ports[0]
    assert "address already in use" in (tmp_path / "extra.log").read_text().lower()
    assert any("sglang::detokenizer" in " ".join(p.cmdline())
               for p in psutil.Process(extra.pid).children(recursive=True))
    # SGLang's load-report file in /dev/shm, which its killed process group cannot unlink: stop() does
    first_files = set(extra._shm_files)
    assert first_files and all(Path(f).exists() for f in first_files), first_files
    clients: list[RecordingClient] = []

    def factory(url: str) -> RecordingClient:
        clients.append(RecordingClient(url))
        return clients[-1]

    pool = EnginePool([sglang_url, extra], client_factory=factory,
                      config=PoolConfig(health_interval_s=0.5, wait_for_server_s=600))
    try:
        pool.start()
        await pool.set_weight_version(0)
        registry = SimRegistry()
        trainer = FifoTrainer(2, registry)
        runner = EpisodeRunner(pool, chat_tokenizer, SamplingParams(max_new_tokens=24),
                               EpisodeBudget(max_turns=3, max_response_tokens=200))
        weights = _Weights(registry, str(tiny_model_path))
        scheduler = RolloutScheduler(
            runner=runner, engine=pool, make_env=LetterTurnsEnv, env_name="letters", tasks=task_stream(),
            sink=trainer, weights=weights,
            config=RolloutConfig(n_samples=2, groups_per_step=2, max_staleness=1, max_running_groups=4,
                                 group_retries=4))
        steps = 4
        async with asyncio.timeout(900):
            train = asyncio.create_task(trainer.run(steps))
            run = asyncio.create_task(scheduler.run(total_groups=steps * 2, final_version=steps))
            while pool.stats()[1].inflight == 0:  # kill the extra server while it is generating
                await asyncio.sleep(0.05)
            extra.kill()
            stats = await run
            await train
            while pool.stats()[1].state != "up":
                await asyncio.sleep(0.5)
        assert pool.stats()[1].restarts == 1
        assert not any(Path(f).exists() for f in first_files), "the killed incarnation's /dev/shm file is left"
        second_files = set(extra._shm_files)
        assert second_files and not second_files & first_files
        # back with the CURRENT weights, not the ones it was started with
        assert await clients[1].weight_version() == steps == await pool.weight_version()
        assert stats.groups_queued == steps * 2 and stats.groups_failed == 0
        multi_turn = [t for group in trainer.puts for t in group if len(t.turns) > 1]
        assert multi_turn
        for t in multi_turn:
            assert len(_servers_of(t, clients)) == 1, "all turns of an episode go to one server"
        served_before = len(clients[1].inputs)
        await asyncio.gather(*(pool.generate([i, 7, 8], SamplingParams(max_new_tokens=2), sticky_key=f"new{i}")
                               for i in range(4)))
        assert len(clients[1].inputs) > served_before, "the restarted server is back in rotation"
    finally:
        await pool.aclose()  # stops the server it restarted
    assert not any(Path(f).exists() for f in second_files)
    # a deliberate stop of a CPU server skips SGLang's crash diagnostics (they cost every stop a 5 s sleep)
    assert "No live scheduler processes found" not in (tmp_path / "extra.log").read_text()


class _Weights:
    """The trainer's versions, as paths the servers can load (the same weights, new version numbers)."""

    def __init__(self, registry: SimRegistry, path: str) -> None:
        self.registry, self.path = registry, path

    async def wait_for(self, min_version: int, *, timeout_s: float):
        got = await self.registry.wait_for(min_version, timeout_s=timeout_s)
        return type(got)(got.version, self.path)


class _Watched:
    """The session's server as a pool member the pool may restart: a restart is recorded, never done."""

    def __init__(self, server) -> None:
        self.server, self.restarts = server, 0

    @property
    def url(self) -> str:
        return self.server.url

    def alive(self) -> bool:
        return self.server.alive()

    def cpu_seconds(self):
        return self.server.cpu_seconds()

    def restart(self) -> None:
        self.restarts += 1
        raise EngineError("the test does not restart the shared server")

    def stop(self, timeout_s: float = 0) -> None: ...


async def test_a_starved_server_is_slow_not_dead_and_is_not_restarted(sglang_server) -> None:
    """SIGSTOP the real server's processes (a machine so busy that nothing of it runs) for longer than it takes
    /health to fail twice, but less than hung_after_s: the pool waits instead of restarting it."""
    watched = _Watched(sglang_server)
    config = PoolConfig(health_interval_s=0.5, health_timeout_s=1.0, failures_to_down=2, hung_after_s=15.0,
                        max_restarts=1)
    pool = EnginePool([watched], config=config)
    async with pool:
        client = SGLangClient(sglang_server.url)
        os.killpg(sglang_server.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(1.0)
            assert await client.probe(1.0) == "unresponsive"
            await asyncio.sleep(5.0)  # /health failed about ten times by now
        finally:
            os.killpg(sglang_server.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not await client.health(2.0) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        await client.aclose()
        assert watched.restarts == 0 and pool.stats()[0].state == "up"
        out = await pool.generate([1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True))
        assert len(out.output_ids) == 2
