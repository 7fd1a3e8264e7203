"""SkipSolved: mastered prompts are skipped (but rechecked), unsolved ones never; the scheduler reports every
finished group to it, also the ones dynamic sampling drops."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest
from rollout_support import FifoTrainer, OneTurnEnv, SimEngine, SimRegistry

from agentrl.async_rollout import EpisodeRunner, RolloutConfig, RolloutScheduler, SkipSolved
from agentrl.async_rollout.curriculum import solved, task_key
from agentrl.engine.base import SamplingParams
from agentrl.errors import ConfigError
from agentrl.rewards import RewardResult
from agentrl.types import FinishReason, Task, Trajectory


def traj(reward: float, **breakdown: float) -> Trajectory:
    return Trajectory(trajectory_id="x", prompt_id="p", group_id="g", token_ids=np.array([1, 2]), prompt_len=1,
                      loss_mask=np.array([0, 1]), behavior_logprobs=np.zeros(2), weight_versions=np.array([-1, 0]),
                      reward=reward, finish_reason=FinishReason.STOP, reward_breakdown=breakdown)


def keyed(*keys: str):
    """An endless stream cycling through prompts of the given wordings (``metadata["template"]``)."""
    for i in itertools.count():
        key = keys[i % len(keys)]
        yield Task(id=f"{key}{i}", prompt=f"{key} #{i}", metadata={"template": key})


def test_solved_reads_the_correct_component_else_the_reward():
    assert solved(traj(1.1, correct=1.0, format=0.1)) and not solved(traj(1.0, correct=0.0, format=1.0))
    assert solved(traj(1.0)) and not solved(traj(0.5))
    assert task_key(Task(id="a", prompt="What is 2?", metadata={"template": "What is {a}?"})) == "What is {a}?"
    assert task_key(Task(id="a", prompt="What is 2?")) == "What is 2?"


def test_a_key_is_mastered_once_its_last_window_groups_reach_the_threshold():
    s = SkipSolved(keyed("A"), window=2, threshold=0.9)
    task = Task(id="A0", prompt="A", metadata={"template": "A"})
    s.observe(task, [traj(1.0)] * 8)
    assert not s.mastered("A"), "one group is less than the window"
    s.observe(task, [traj(1.0)] * 7 + [traj(0.0)])
    assert s.mastered("A")  # 15 of 16 >= 0.9
    s.observe(task, [traj(1.0)] * 6 + [traj(0.0)] * 2)
    assert not s.mastered("A")  # last two groups: 13 of 16 < 0.9, the first group has left the window
    s.threshold = 13 / 16
    assert s.mastered("A"), "the rate over the window is exactly 13 of 16"


def test_mastered_wordings_are_skipped_but_rechecked_and_unsolved_ones_never():
    s = SkipSolved(keyed("easy", "hard"), window=1, threshold=1.0, keep=0.25, seed=3)
    s.observe(Task(id="e", prompt="e", metadata={"template": "easy"}), [traj(1.0)] * 4)
    s.observe(Task(id="h", prompt="h", metadata={"template": "hard"}), [traj(0.0)] * 4)
    drawn = [task_key(next(s)) for _ in range(2000)]
    easy = drawn.count("easy") / drawn.count("hard")
    assert 0.18 < easy < 0.32, f"a mastered wording should come back about keep = 0.25 as often, got {easy:.3f}"
    assert s.skipped == pytest.approx(3 * drawn.count("easy"), rel=0.25)
    assert drawn.count("hard") == 2000 - drawn.count("easy"), "unsolved wordings are never skipped"


@pytest.mark.parametrize("kw", [{"window": 0}, {"threshold": 0.0}, {"threshold": 1.5}, {"keep": 0.0}])
def test_settings_that_could_never_recheck_are_refused(kw):
    with pytest.raises(ConfigError, match="skip_solved"):
        SkipSolved(keyed("A"), **kw)


async def test_the_scheduler_reports_every_group_and_skips_what_is_mastered(chat_tokenizer):
    class Env(OneTurnEnv):  # "easy" prompts always succeed, "hard" ones half the time
        async def score(self, response):
            hard = self.task.metadata["template"] == "hard"
            return RewardResult.scored(float(self.rng.random() < 0.5) if hard else 1.0)

    groups_per_step, steps = 2, 6
    engine, registry = SimEngine(lambda key: 0.001), SimRegistry()
    trainer = FifoTrainer(groups_per_step, registry)
    tasks = SkipSolved(keyed("easy", "hard"), window=1, keep=0.25)
    seen: list[str] = []
    observe = tasks.observe
    tasks.observe = lambda task, group: (seen.append(task_key(task)), observe(task, group))[-1]  # type: ignore
    scheduler = RolloutScheduler(
        runner=EpisodeRunner(engine, chat_tokenizer, SamplingParams(max_new_tokens=4)), engine=engine,
        make_env=Env, env_name="one", tasks=tasks, sink=trainer, weights=registry,
        config=RolloutConfig(n_samples=6, groups_per_step=groups_per_step, max_staleness=1, max_running_groups=2,
                             drop_uniform_groups=True))
    async with asyncio.timeout(60):
        train = asyncio.create_task(trainer.run(steps))
        stats = await scheduler.run(total_groups=steps * groups_per_step, final_version=steps)
        await train
    ran = stats.groups_queued + stats.groups_filtered  # hard groups all-equal by chance are filtered too
    assert len(seen) == ran, "every finished group, queued or filtered, must be observed"
    assert tasks.skipped > 0 and seen.count("easy") < seen.count("hard")
    assert sum(n for _, n in stats.solved_by_version.values()) == 6 * ran
    easy_solved = 6 * seen.count("easy")
    assert sum(s for s, _ in stats.solved_by_version.values()) >= easy_solved
    # the same outcomes by task key: every "easy" episode solved from v0 on, "hard" ones about half
    easy, hard = stats.solved_by_key["easy"], stats.solved_by_key["hard"]
    assert easy == [easy_solved, easy_solved, 0]
    assert hard[1] == 6 * seen.count("hard") and 0 < hard[0] < hard[1] and hard[2] >= 0
    assert sum(s for s, _, _ in stats.solved_by_key.values()) == sum(s for s, _ in stats.solved_by_version.values())


async def test_the_outcomes_by_key_are_bounded_to_the_first_keys(chat_tokenizer, monkeypatch):
    """A dataset's prompts are keys: past KEYS_TRACKED of them, a new key's groups are counted, not kept."""
    from agentrl.async_rollout import scheduler as scheduler_mod

    monkeypatch.setattr(scheduler_mod, "KEYS_TRACKED", 2)

    class Env(OneTurnEnv):
        async def score(self, response):
            return RewardResult.scored(1.0)

    engine, registry = SimEngine(lambda key: 0.001), SimRegistry()
    trainer = FifoTrainer(1, registry)
    scheduler = RolloutScheduler(
        runner=EpisodeRunner(engine, chat_tokenizer, SamplingParams(max_new_tokens=4)), engine=engine,
        make_env=Env, env_name="one", tasks=keyed("a", "b", "c"), sink=trainer, weights=registry,
        config=RolloutConfig(n_samples=2, groups_per_step=1, max_staleness=1, max_running_groups=1))
    async with asyncio.timeout(60):
        train = asyncio.create_task(trainer.run(6))
        stats = await scheduler.run(total_groups=6, final_version=6)
        await train
    assert set(stats.solved_by_key) == {"a", "b"}  # one group at a time: the stream's order
    assert stats.solved_by_key["a"] == [4, 4, 0] and stats.solved_by_key["b"][:2] == [4, 4]
    assert stats.groups_untracked_key == 2  # the two groups of "c"
