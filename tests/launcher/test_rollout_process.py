"""The rollout process hands each component its own part of the run's configuration, as is."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentrl.env import default_registry
from agentrl.env.agent import agent_factory
from agentrl.env.registry import EnvResources
from agentrl.gateway import GatewayConfig, SessionLimits
from agentrl.launcher.config import load_config
from agentrl.launcher.rollout_process import RolloutWorker


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
