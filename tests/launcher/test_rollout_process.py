"""The rollout process hands each component its own part of the run's configuration, as is."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from agentrl.env import default_registry
from agentrl.env.agent import agent_factory
from agentrl.env.registry import EnvResources
from agentrl.gateway import GatewayConfig, SessionLimits
from agentrl.launcher.config import load_config
from agentrl.launcher.rollout_process import RolloutWorker, WeightHold

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "async_rollout"))
from rollout_support import FifoTrainer, OneTurnEnv, SimEngine, SimRegistry, task_stream  # noqa: E402


def test_episodes_get_the_runs_sampling_and_budget(tmp_path: Path) -> None:
    cfg = load_config(None, ["rollout.top_k=20", "rollout.max_resumes=2", "rollout.temperature=0.8"])
    worker = RolloutWorker(cfg, tmp_path, "redis://unused")
    worker.engine, worker.tok = object(), object()  # what start() would set; the runner only keeps them
    runner = worker._runner()
    assert runner.sampling is cfg.rollout.sampling and runner.budget is cfg.rollout.budget


async def _agent(task, client) -> str:  # never run: the test only builds the rollout side's objects
    return ""


def test_agent_episodes_get_the_runs_gateway_settings_and_session_limits(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_registry, "envs", dict(default_registry.envs))
    default_registry.register_env("probe_agent", agent_factory(_agent))
    cfg = load_config(None, ["env.name=probe_agent", "env.options.tool_parser=qwen25", "gateway.max_tokens=77",
                             "rollout.max_resumes=2", "rollout.temperature=0.8"])
    worker = RolloutWorker(cfg, tmp_path, "redis://unused")
    worker.resources = EnvResources()
    assert worker._gateway_config() == GatewayConfig(model_name=cfg.model, tool_parser="qwen25", max_tokens=77)
    worker.gateway, worker.tok = object(), object()  # what start() would set
    runner = worker._runner()
    assert runner.limits == SessionLimits.for_episode(cfg.rollout.budget, cfg.rollout.sampling)
    assert runner.limits.max_resumes == 2 and runner.limits.temperature == 0.8


async def test_the_engine_pool_and_its_clients_get_the_runs_engine_settings(tmp_path: Path) -> None:
    cfg = load_config(None, ["engine.max_restarts=1", "engine.wait_for_server_s=5", "engine.generate_s=42"])
    pool = RolloutWorker(cfg, tmp_path, "redis://unused")._pool(["http://127.0.0.1:9", "http://127.0.0.1:10"])
    try:
        assert pool.config is cfg.engine.pool and pool.config.max_restarts == 1
        assert [m.client.timeouts for m in pool._members] == [cfg.engine.timeouts] * 2
        assert cfg.engine.timeouts.generate_s == 42
    finally:
        await pool.aclose()


def test_the_worker_reports_memory_only_from_a_sampler_of_its_own(tmp_path: Path) -> None:
    """A Ray actor's worker samples its own process and reports it; in debug mode it adds its watches to the
    controller's sampler, which reports them: reported twice, they would be counted twice."""
    import asyncio

    from agentrl.launcher.memory import MemorySampler

    cfg = load_config(None, [])
    shared = MemorySampler()
    assert asyncio.run(RolloutWorker(cfg, tmp_path, "redis://unused", memory=shared).memory_report()) is None
    own = RolloutWorker(cfg, tmp_path, "redis://unused")
    own.memory.watch("rollout", os.getpid())
    own.memory.sample()
    report = asyncio.run(own.memory_report())
    assert report is not None and report["peaks"]["rollout"] > 0 and report["processes"] == 1


@pytest.mark.parametrize(("overrides", "shared"), [
    ([], True),  # the pool's sticky routing: a group's samples on one server
    (["engine.router=true"], True),  # cache_aware, the default policy: where the prefix is cached
    (["engine.router=true", "engine.router_policy=round_robin", "engine.num_servers=2"], False),  # spread over them
    (["engine.router=true", "engine.router_policy=power_of_two", "engine.url=http://a:1,http://b:2"], False),
    (["engine.router=true", "engine.router_policy=round_robin"], True),  # one server: nowhere else to go
    (["engine.router=true", "engine.router_policy=random", "engine.url=http://a:1,"], True),
    (["rollout.n_samples=1"], False),  # nothing to share
])
def test_a_groups_prompt_is_prefilled_once_only_where_its_samples_meet_the_prefill(
        tmp_path: Path, overrides: list[str], shared: bool) -> None:
    from agentrl.async_rollout.episode import SharedPrefill

    class Engine:  # prefill-capable: the runner's choice is the launcher's
        async def generate(self, input_ids, sampling, *, sticky_key=None): ...
        async def prefill(self, input_ids, *, sticky_key=None): ...

    cfg = load_config(None, ["rollout.n_samples=4", *overrides])
    worker = RolloutWorker(cfg, tmp_path, "redis://unused")
    worker.engine, worker.tok = Engine(), object()
    assert isinstance(worker._runner().shared_prefill, SharedPrefill) is shared



async def test_a_held_evaluation_keeps_published_versions_from_loading_until_it_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sft evaluation runs beside RL's first rollouts: the controller takes the hold first, so a version
    published meanwhile reaches the scheduler (which would pause the engine and load it) only once the evaluation
    has finished, and as the newest one (v1 may be pruned by then); the evaluation releases the hold also when it
    fails, and an evaluation without it (the mid-run ones) lets a version through at once."""
    import asyncio

    from agentrl.launcher import rollout_process

    release = asyncio.Event()
    fail = False

    async def evaluation(cfg, tasks, **kwargs):  # the held-out evaluation, until the test releases it
        await release.wait()
        if fail:
            raise RuntimeError("the engine went away")
        return {"n": len(tasks), "accuracy": 1.0}, []

    monkeypatch.setattr(rollout_process, "heldout_eval", evaluation)
    worker = RolloutWorker(load_config(None, ["data.num_heldout=2"]), tmp_path, "redis://unused")
    registry = SimRegistry()
    worker.resources, worker.weights, worker.tok = EnvResources(), WeightHold(registry), object()
    loads = asyncio.ensure_future(worker.weights.wait_for(1, timeout_s=30))  # the scheduler, already waiting
    await worker.hold_weights()
    held = asyncio.ensure_future(worker.evaluate_heldout("sft", release_weights=True))
    await registry.publish(1)
    await registry.publish(2)
    await asyncio.sleep(0.2)
    assert worker.weights.held and not loads.done(), "a version published during the held evaluation went through"
    release.set()
    figures, _ = await held
    assert figures["label"] == "sft" and figures["n"] == 2
    assert (await asyncio.wait_for(loads, 5)).version == 2 and not worker.weights.held and worker._busy == 0

    release.clear()  # a mid-run evaluation: no hold
    unheld = asyncio.ensure_future(worker.evaluate_heldout("v5"))
    await registry.publish(3)
    assert (await asyncio.wait_for(worker.weights.wait_for(3, timeout_s=30), 5)).version == 3
    release.set()
    await unheld

    fail = True
    await worker.hold_weights()
    with pytest.raises(RuntimeError, match="went away"):
        await worker.evaluate_heldout("sft", release_weights=True)
    assert not worker.weights.held
    with pytest.raises(RuntimeError, match="nobody took"):
        worker.weights.release()


async def test_the_scheduler_generates_on_the_held_weights_and_then_loads_the_newest(chat_tokenizer) -> None:
    """The real scheduler following a held :class:`WeightHold`: it never pauses the engine (the held evaluation
    shares it) and keeps generating on v0 within η while the trainer publishes; released, it loads the newest
    version, not the first one published meanwhile, and the run completes."""
    import asyncio

    from agentrl.async_rollout import EpisodeBudget, EpisodeRunner, RolloutConfig, RolloutScheduler
    from agentrl.engine.base import SamplingParams

    engine = SimEngine(lambda key: 0.002)
    pauses: list[str] = []
    pause = engine.pause

    async def recorded_pause(mode: str = "abort") -> None:
        pauses.append(mode)
        await pause(mode)

    engine.pause = recorded_pause
    registry = SimRegistry()
    trainer = FifoTrainer(2, registry)
    hold = WeightHold(registry)
    hold.take()
    scheduler = RolloutScheduler(
        runner=EpisodeRunner(engine, chat_tokenizer, SamplingParams(max_new_tokens=8),
                             EpisodeBudget(max_turns=1, max_response_tokens=8)),
        engine=engine, make_env=lambda: OneTurnEnv(seed=None), env_name="one", tasks=task_stream(), sink=trainer,
        weights=hold, config=RolloutConfig(n_samples=3, groups_per_step=2, max_staleness=1, max_running_groups=4,
                                           update_mode="interrupt"))
    async with asyncio.timeout(60):
        train = asyncio.create_task(trainer.run(4))
        run = asyncio.create_task(scheduler.run(total_groups=8, final_version=4))
        while registry.latest < 2:  # steps 1 and 2 trained on v0's groups (η = 1)
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        assert pauses == [] and engine.loads == [] and scheduler.version == 0
        assert trainer.version == 2 and not train.done(), "step 3 waits for groups the gate holds back"
        hold.release()
        stats = await run
        await train
    assert engine.loads[0] == 2 and 1 not in engine.loads and pauses
    assert stats.groups_queued == 8 and max(trainer.staleness) <= 1
