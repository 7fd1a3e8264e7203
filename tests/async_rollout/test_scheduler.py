"""The rollout scheduler against a simulated engine and a FIFO trainer: groups kept together, the staleness bound
η enforced at the moment the trainer consumes (also for episodes far slower than the rest), the three update
modes, dynamic sampling, retries of groups hit by infrastructure failures."""

from __future__ import annotations

import asyncio

import pytest
from rollout_support import FifoTrainer, OneTurnEnv, SimEngine, SimRegistry, task_stream

from agentrl.async_rollout import EpisodeBudget, EpisodeRunner, RolloutConfig, RolloutScheduler
from agentrl.engine.base import SamplingParams
from agentrl.errors import EngineError
from agentrl.rewards import RewardResult

B, N = 2, 3  # groups per step, samples per group


def slow_first_group(factor: float = 60.0, base_s: float = 0.002):
    """Per-token time: the first group admitted is ``factor`` × slower than the others."""
    return lambda key: base_s * (factor if key is not None and key.endswith("#0") else 1.0)


def slow_first_episode(factor: float = 60.0, base_s: float = 0.002):
    """Per-token time: only the first request of the first group is slow; its siblings finish early."""
    seen: set[str] = set()

    def token_s(key: str | None) -> float:
        first = key is not None and key.endswith("#0") and key not in seen
        if key is not None:
            seen.add(key)
        return base_s * (factor if first else 1.0)

    return token_s


async def run(chat_tokenizer, *, mode: str, eta: int, steps: int = 8, token_s=None, env=None, tokens: int = 12,
              engine=None, **config):
    engine = engine or SimEngine(token_s or slow_first_group())
    registry = SimRegistry()
    trainer = FifoTrainer(B, registry)
    runner = EpisodeRunner(engine, chat_tokenizer, SamplingParams(max_new_tokens=tokens),
                           EpisodeBudget(max_turns=1, max_response_tokens=tokens))
    scheduler = RolloutScheduler(
        runner=runner, engine=engine, make_env=env or (lambda: OneTurnEnv(seed=None)), env_name="one",
        tasks=task_stream(), sink=trainer, weights=registry,
        config=RolloutConfig(n_samples=N, groups_per_step=B, max_staleness=eta, max_running_groups=4,
                             update_mode=mode, **config),
    )
    train = asyncio.create_task(trainer.run(steps))
    try:
        async with asyncio.timeout(120):
            stats = await scheduler.run(total_groups=steps * B, final_version=steps)
            await train
    finally:
        train.cancel()
    return trainer, stats, engine


@pytest.mark.parametrize("slow", [slow_first_group, slow_first_episode])
@pytest.mark.parametrize("mode", ["drain", "interrupt", "abort_restart"])
@pytest.mark.parametrize("eta", [0, 1, 2])
async def test_no_trajectory_is_consumed_more_than_eta_versions_stale(chat_tokenizer, mode, eta, slow):
    trainer, stats, engine = await run(chat_tokenizer, mode=mode, eta=eta, token_s=slow())
    assert len(trainer.staleness) == 8 * B * N  # every step got its groups
    assert max(trainer.staleness) <= eta, trainer.staleness
    assert stats.staleness_max == max(trainer.staleness)
    assert engine.loads == list(range(1, 9)) and stats.versions_loaded == list(range(1, 9))
    if eta > 0:  # the slow group could not keep up: the bound was enforced by restarting it, not by luck
        assert stats.groups_restarted_stale + stats.episodes_restarted > 0


async def test_groups_are_kept_together(chat_tokenizer):
    trainer, stats, _ = await run(chat_tokenizer, mode="interrupt", eta=1, token_s=lambda key: 0.001)
    assert len(trainer.puts) == 8 * B and stats.groups_queued == 8 * B
    for group in trainer.puts:
        assert len(group) == N
        assert len({t.group_id for t in group}) == 1 and len({t.prompt_id for t in group}) == 1
    assert len({g[0].group_id for g in trainer.puts}) == len(trainer.puts)


async def test_abort_restart_runs_every_episode_on_one_version_and_interrupt_spans_versions(chat_tokenizer):
    def steady(key):
        return 0.004

    trainer, stats, _ = await run(chat_tokenizer, mode="abort_restart", eta=2, token_s=steady, tokens=40)
    assert all(len(set(t.generated_versions)) == 1 for g in trainer.puts for t in g)
    assert stats.episodes_restarted > 0

    trainer, stats, _ = await run(chat_tokenizer, mode="interrupt", eta=2, token_s=steady, tokens=40)
    spanning = [t for g in trainer.puts for t in g if len(set(t.generated_versions)) > 1]
    assert spanning, "an update should have landed mid-episode"
    for t in spanning:  # versions never go back within an episode
        assert t.generated_versions == sorted(t.generated_versions)


@pytest.mark.parametrize("pause_mode", ["abort", "retract", "in_place"])
async def test_interrupt_with_each_pause_mode_keeps_exact_token_counts(chat_tokenizer, pause_mode):
    trainer, _, _ = await run(chat_tokenizer, mode="interrupt", eta=1, token_s=lambda key: 0.003, tokens=20,
                              steps=4, pause_mode=pause_mode)
    # an aborted request is resumed by the runner, a retracted one continues on the server: 20 tokens either way
    assert all(t.num_model_tokens == 20 for g in trainer.puts for t in g)


async def test_dynamic_sampling_drops_groups_whose_rewards_are_all_equal(chat_tokenizer):
    class Env(OneTurnEnv):
        async def score(self, response):
            if int(self.task.id[1:]) % 3 == 0:  # tasks 0, 3, 6, … always score 1: no GRPO signal
                return RewardResult.scored(1.0)
            return RewardResult.scored(float(self.rng.random() < 0.5))

    engine = SimEngine(lambda key: 0.001)
    registry = SimRegistry()
    trainer = FifoTrainer(B, registry)
    runner = EpisodeRunner(engine, chat_tokenizer, SamplingParams(max_new_tokens=4))
    scheduler = RolloutScheduler(
        runner=runner, engine=engine, make_env=Env, env_name="one", tasks=task_stream(), sink=trainer,
        weights=registry, config=RolloutConfig(n_samples=6, groups_per_step=B, max_staleness=1,
                                               update_mode="interrupt", drop_uniform_groups=True))
    async with asyncio.timeout(60):
        train = asyncio.create_task(trainer.run(4))
        stats = await scheduler.run(total_groups=4 * B, final_version=4)
        await train
    assert stats.groups_queued == 4 * B and stats.groups_filtered >= 3  # tasks 0, 3, 6 at least
    assert all(len({t.reward for t in g}) > 1 for g in trainer.puts)
    assert all(int(g[0].prompt_id[1:]) % 3 != 0 for g in trainer.puts)
    queued = sum(t.num_model_tokens for g in trainer.puts for t in g)
    assert stats.model_tokens == queued > 0
    assert stats.generated_tokens >= queued + 6 * stats.groups_filtered  # ≥ 1 token per filtered episode too


async def test_a_group_hit_by_an_engine_failure_is_retried_whole(chat_tokenizer):
    class Flaky(SimEngine):
        failed = 0

        async def generate(self, ids, sampling, *, sticky_key=None):
            if sticky_key.endswith("#1") and self.failed < 2:
                self.failed += 1
                raise EngineError("http://sim/generate: the server dropped the connection")
            return await super().generate(ids, sampling, sticky_key=sticky_key)

    engine = Flaky(lambda key: 0.001)
    trainer, stats, _ = await run(chat_tokenizer, mode="interrupt", eta=1, steps=2, engine=engine)
    assert engine.failed == 2 and stats.groups_failed == 0 and stats.groups_queued == 2 * B
    assert all(len(g) == N for g in trainer.puts)


async def test_a_group_whose_reward_could_not_be_computed_is_retried_never_queued(chat_tokenizer):
    failed: list[str] = []

    class Env(OneTurnEnv):
        async def score(self, response):
            if self.task.id == "t1" and len(failed) < 2:  # the checker fails twice for task t1
                failed.append(self.task.id)
                return RewardResult.infra_error("the math checker pool died")
            return RewardResult.scored(1.0)

    trainer, stats, _ = await run(chat_tokenizer, mode="interrupt", eta=1, steps=2, env=Env)
    assert failed == ["t1", "t1"] and stats.groups_failed == 0 and stats.groups_queued == 2 * B
    assert all(t.reward == 1.0 for g in trainer.puts for t in g)  # no made-up score of 0 went to the trainer
    assert [len(g) for g in trainer.puts if g[0].prompt_id == "t1"] == [N]  # retried whole, queued once


async def test_an_engine_that_keeps_failing_stops_the_run_with_its_error(chat_tokenizer):
    class Down(SimEngine):
        async def generate(self, ids, sampling, *, sticky_key=None):
            raise EngineError("http://sim/generate: cannot connect after 4 attempts")

    with pytest.raises(Exception) as err:
        await run(chat_tokenizer, mode="interrupt", eta=1, steps=2, engine=Down(lambda key: 0.001),
                  max_failed_groups=3, group_retries=1)
    assert "groups failed" in str(err.value) and not isinstance(err.value, BaseExceptionGroup)


@pytest.mark.parametrize("budget", [0.0, 0.5])
async def test_dynamic_sampling_stays_within_its_dropping_budget(chat_tokenizer, budget):
    class Env(OneTurnEnv):  # two of three tasks always score 1: uniform, no GRPO signal
        async def score(self, response):
            if int(self.task.id[1:]) % 3:
                return RewardResult.scored(1.0)
            return RewardResult.scored(float(self.rng.random() < 0.5))

    engine = SimEngine(lambda key: 0.001)
    registry = SimRegistry()
    trainer = FifoTrainer(B, registry)
    scheduler = RolloutScheduler(
        runner=EpisodeRunner(engine, chat_tokenizer, SamplingParams(max_new_tokens=4)), engine=engine, make_env=Env,
        env_name="one", tasks=task_stream(), sink=trainer, weights=registry,
        config=RolloutConfig(n_samples=6, groups_per_step=B, max_staleness=1, drop_uniform_groups=True,
                             max_dropped_per_queued=budget))
    async with asyncio.timeout(60):
        train = asyncio.create_task(trainer.run(4))
        stats = await scheduler.run(total_groups=4 * B, final_version=4)
        await train
    assert stats.groups_queued == 4 * B
    assert stats.groups_filtered <= budget * stats.groups_queued + 1e-9
    uniform = sum(len({t.reward for t in g}) == 1 for g in trainer.puts)
    assert uniform == stats.groups_uniform_queued > 0  # the budget ran out: uniform groups were queued, and counted
    if budget:
        assert stats.groups_filtered > 0


async def test_an_episode_of_several_trajectories_makes_a_larger_group_that_says_its_size(chat_tokenizer):
    """Agent episodes yield one trajectory per token branch: the group keeps them all and says how many."""
    engine = SimEngine(lambda key: 0.001)
    inner = EpisodeRunner(engine, chat_tokenizer, SamplingParams(max_new_tokens=4), EpisodeBudget(max_turns=1))
    calls = 0

    class Forking:
        async def episode(self, env, task, *, env_name="", group_id=""):
            nonlocal calls
            calls += 1
            forked = calls % 3 == 1
            [t] = await inner.episode(env, task, env_name=env_name, group_id=group_id)
            return [t, t] if forked else [t]  # the 1st, 4th, ... episode "forked"

    registry = SimRegistry()
    trainer = FifoTrainer(1, registry)
    scheduler = RolloutScheduler(
        runner=Forking(), engine=engine, make_env=lambda: OneTurnEnv(seed=0), env_name="one", tasks=task_stream(),
        sink=trainer, weights=registry, config=RolloutConfig(n_samples=3, groups_per_step=1, max_running_groups=1))
    train = asyncio.create_task(trainer.run(2))
    async with asyncio.timeout(60):
        stats = await scheduler.run(total_groups=2, final_version=2)
        await train
    assert [len(g) for g in trainer.puts] == [4, 4]
    assert all(t.metadata["group_size"] == 4 for g in trainer.puts for t in g)
    assert stats.trajectories_queued == 8


@pytest.mark.parametrize("rounds", [0, 1, 2])
async def test_adaptive_sampling_resamples_unsolved_groups_and_keeps_a_balanced_group(chat_tokenizer, rounds):
    """A task first solved by its (N + 1)-th episode: with resample_unsolved >= 1 a second round finds it, and the
    queued group is cut back to N with that episode in it and the pool's statistics; without, no group holds it."""
    scored: dict[str, int] = {}

    def reward(task):
        scored[task.id] = scored.get(task.id, 0) + 1
        return 1.0 if scored[task.id] == N + 1 else 0.0

    trainer, stats, _ = await run(chat_tokenizer, mode="drain", eta=1, steps=2, token_s=lambda key: 0.001,
                                  env=lambda: OneTurnEnv(reward), resample_unsolved=rounds)
    assert [len(g) for g in trainer.puts] == [N] * 2 * B  # the pool is cut back to the group's size
    solved = [sum(t.reward == 1.0 for t in g) for g in trainer.puts]
    if rounds == 0:
        assert solved == [0] * 2 * B and stats.resample_rounds == 0
        assert not any("reward_pool" in t.metadata for g in trainer.puts for t in g)
        return
    assert solved == [1] * 2 * B  # one solved, N - 1 unsolved: as even as a pool of one solved allows
    assert stats.resample_rounds == stats.groups_rescued == 2 * B  # one round each: the second found it
    assert set(scored.values()) == {2 * N}
    pools = [t.metadata["reward_pool"] for g in trainer.puts for t in g]
    assert all(p["n"] == 2 * N and p["mean"] == pytest.approx(1 / (2 * N)) for p in pools)
    assert not any("group_size" in t.metadata for g in trainer.puts for t in g)


async def test_adaptive_sampling_gives_up_after_its_rounds_keeping_the_newest_episodes(chat_tokenizer):
    """A task never solved: resample_unsolved rounds each, then the group is queued with the last round's episodes
    (the least stale) and the pool's statistics."""
    scored: dict[str, int] = {}

    def reward(task):  # never solved; the k-th episode of a task scores k / 100
        scored[task.id] = scored.get(task.id, 0) + 1
        return scored[task.id] / 100

    trainer, stats, _ = await run(chat_tokenizer, mode="drain", eta=1, steps=2, token_s=lambda key: 0.001,
                                  env=lambda: OneTurnEnv(reward), resample_unsolved=2)
    assert stats.resample_rounds == 2 * 2 * B and stats.groups_rescued == stats.groups_resample_denied == 0
    assert [sorted(round(t.reward * 100) for t in g) for g in trainer.puts] == [[7, 8, 9]] * 2 * B  # N = 3: round 3
    assert all(t.metadata["reward_pool"] == pytest.approx({"n": 9, "mean": 0.05, "std": 0.0273861}, rel=1e-5)
               for g in trainer.puts for t in g)


@pytest.mark.parametrize("budget", [0.0, 0.5])
async def test_adaptive_sampling_rounds_come_out_of_the_dropping_budget(chat_tokenizer, budget):
    """Each extra round counts as a dropped group: within budget x groups queued, the rest of the unsolved groups are
    queued without one (and counted)."""
    trainer, stats, _ = await run(chat_tokenizer, mode="drain", eta=1, steps=4, token_s=lambda key: 0.001,
                                  env=lambda: OneTurnEnv(lambda task: 0.0), resample_unsolved=1,
                                  max_dropped_per_queued=budget)
    assert stats.groups_queued == 4 * B
    assert stats.resample_rounds <= budget * stats.groups_queued + 1e-9
    assert stats.resample_rounds + stats.groups_resample_denied == 4 * B
    assert (stats.resample_rounds > 0) is (budget > 0)
    assert sum("reward_pool" in g[0].metadata for g in trainer.puts) == stats.resample_rounds


async def test_adaptive_sampling_drops_a_pool_whose_rewards_are_all_equal(chat_tokenizer):
    """With dynamic sampling a pool is uniform when all its episodes scored alike (not only the kept ones)."""
    _, stats, _ = await run(chat_tokenizer, mode="drain", eta=1, steps=2, token_s=lambda key: 0.001,
                            env=lambda: OneTurnEnv(lambda task: 0.0), resample_unsolved=1, drop_uniform_groups=True,
                            max_dropped_per_queued=1.0)
    assert stats.groups_filtered > 0 and stats.resample_rounds > 0
    assert stats.groups_filtered + stats.resample_rounds <= 1.0 * stats.groups_queued + 1e-9


async def test_adaptive_sampling_keeps_or_cuts_agent_episodes_whole(chat_tokenizer):
    """An agent episode's branches (several trajectories) stay together through the cut; the group says its size."""
    import dataclasses

    engine = SimEngine(lambda key: 0.001)
    scored: dict[str, int] = {}

    def reward(task):
        scored[task.id] = scored.get(task.id, 0) + 1
        return 1.0 if scored[task.id] == N + 2 else 0.0  # the second episode of the second round

    inner = EpisodeRunner(engine, chat_tokenizer, SamplingParams(max_new_tokens=4), EpisodeBudget(max_turns=1))

    class Forking:  # every episode ends on two branches
        async def episode(self, env, task, *, env_name="", group_id=""):
            [t] = await inner.episode(env, task, env_name=env_name, group_id=group_id)
            return [t, dataclasses.replace(t, trajectory_id=t.trajectory_id + "/b", metadata=dict(t.metadata))]

    registry = SimRegistry()
    trainer = FifoTrainer(1, registry)
    scheduler = RolloutScheduler(
        runner=Forking(), engine=engine, make_env=lambda: OneTurnEnv(reward), env_name="one", tasks=task_stream(),
        sink=trainer, weights=registry,
        config=RolloutConfig(n_samples=N, groups_per_step=1, max_running_groups=1, resample_unsolved=1))
    train = asyncio.create_task(trainer.run(2))
    async with asyncio.timeout(60):
        stats = await scheduler.run(total_groups=2, final_version=2)
        await train
    assert stats.groups_rescued == 2
    for g in trainer.puts:
        ids = {t.trajectory_id for t in g}
        assert len(g) == 2 * N and all(t.metadata["group_size"] == 2 * N for t in g)
        assert all(i + "/b" in ids for i in ids if not i.endswith("/b"))  # whole episodes
        assert sum(t.reward == 1.0 for t in g) == 2  # the solved episode, both its branches
        assert g[0].metadata["reward_pool"]["n"] == 4 * N
