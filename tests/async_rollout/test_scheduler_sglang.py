"""The scheduler for real: SGLang (tiny model), Redis (TrajectoryQueue + WeightRegistry) and the trainer's own
group reader (``agentrl.launcher.protocol.read_groups``). A stand-in trainer consumes, checks staleness, acks and
publishes new versions (the same weights, new version numbers); every consumed trajectory is within η and its
tokens are exactly what SGLang returned (lengths, masks, versions)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from rollout_support import OneTurnEnv, task_stream

from agentrl.async_rollout import EpisodeBudget, EpisodeRunner, RolloutConfig, RolloutScheduler
from agentrl.engine import SamplingParams, SGLangClient
from agentrl.queue import TrajectoryQueue, WeightRegistry

pytestmark = [pytest.mark.sglang, pytest.mark.redis]

B, N, STEPS, ETA = 2, 2, 3, 1


async def run_with_trainer(sglang_url, redis_client, chat_tokenizer, tiny_model_path, *, env, config: RolloutConfig,
                           steps: int, max_new_tokens: int):
    """The scheduler on SGLang and Redis beside a stand-in trainer that reads ``steps`` batches with the trainer's
    reader, acks them and publishes the same weights as the next version. Returns the batches consumed, the
    scheduler's stats and the weight version SGLang serves at the end."""
    from agentrl.launcher.protocol import read_groups

    name = f"test:{uuid.uuid4().hex[:8]}"
    queue = TrajectoryQueue(redis_client, f"{name}:traj", consumer="trainer-0", capacity=64)
    registry = WeightRegistry(redis_client, name)
    consumed: list[list] = []
    async with SGLangClient(sglang_url) as client:
        await client.set_weight_version(0)
        await registry.publish(0, str(tiny_model_path), step=0)
        runner = EpisodeRunner(client, chat_tokenizer, SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0),
                               EpisodeBudget(max_turns=1, max_response_tokens=max_new_tokens))
        scheduler = RolloutScheduler(runner=runner, engine=client, make_env=env, env_name="one", tasks=task_stream(),
                                     sink=queue, weights=registry, config=config)

        async def trainer() -> None:
            carry: dict = {}
            for version in range(steps):
                entries = await read_groups(queue, groups=config.groups_per_step, group_size=config.n_samples,
                                            carry=carry, stop_after_s=300)
                consumed.append([e.trajectory for e in entries])
                await queue.ack([e.entry_id for e in entries])
                await registry.publish(version + 1, str(tiny_model_path), step=version + 1)

        async with asyncio.timeout(600):
            train = asyncio.create_task(trainer())
            stats = await scheduler.run(total_groups=steps * config.groups_per_step, final_version=steps)
            await train
        served = await client.weight_version()
    await queue.aclose()
    await registry.aclose()
    return consumed, stats, served


@pytest.mark.parametrize("mode", ["interrupt", "abort_restart"])
async def test_scheduler_with_sglang_redis_and_the_trainers_reader(sglang_url, redis_client, chat_tokenizer,
                                                                   tiny_model_path, mode):
    consumed, stats, served = await run_with_trainer(
        sglang_url, redis_client, chat_tokenizer, tiny_model_path, env=lambda: OneTurnEnv(), steps=STEPS,
        max_new_tokens=24, config=RolloutConfig(n_samples=N, groups_per_step=B, max_staleness=ETA,
                                                max_running_groups=3, update_mode=mode))
    assert served == STEPS
    assert len(consumed) == STEPS and all(len(ts) == B * N for ts in consumed)
    for version, trajectories in enumerate(consumed):
        for t in trajectories:
            assert version - t.min_version <= ETA
            assert t.num_model_tokens == 24 or t.token_ids[-1] == chat_tokenizer.eos_token_id
            assert t.loss_mask.tolist() == [0] * t.prompt_len + [1] * (t.num_tokens - t.prompt_len)
            assert t.generated_versions == sorted(t.generated_versions)
    assert stats.versions_loaded == [1, 2, 3] and stats.groups_queued == STEPS * B


async def test_adaptive_sampling_with_sglang_redis_and_the_trainers_prepare(sglang_url, redis_client, chat_tokenizer,
                                                                            tiny_model_path):
    """resample_unsolved on the real path: each task is first solved by its (N + 1)-th episode, so every group runs a
    second round on SGLang, is cut back to N (the solved episode kept), crosses Redis with its pool's statistics, is
    read by the trainer's reader and gets the pool's baseline in the trainer's own ``prepare_rl``."""
    from agentrl.trainer.collate import prepare_rl
    from agentrl.trainer.config import LossConfig

    scored: dict[str, int] = {}

    def reward(task):
        scored[task.id] = scored.get(task.id, 0) + 1
        return 1.0 if scored[task.id] == N + 1 else 0.0

    # no dropping budget: both groups start before any is queued, and a budget would refuse one of them its round
    # depending on timing
    config = RolloutConfig(n_samples=N, groups_per_step=B, max_staleness=ETA, max_running_groups=2,
                           resample_unsolved=1, max_dropped_per_queued=None)
    consumed, stats, _ = await run_with_trainer(sglang_url, redis_client, chat_tokenizer, tiny_model_path,
                                                env=lambda: OneTurnEnv(reward), config=config, steps=2,
                                                max_new_tokens=16)
    assert stats.resample_rounds == stats.groups_rescued == 2 * B and stats.groups_resample_denied == 0
    assert set(scored.values()) == {2 * N}  # two rounds of N episodes per task, no more
    mean = 1 / (2 * N)  # one solved episode in a pool of 2N
    std = (mean * (1 - mean) * 2 * N / (2 * N - 1)) ** 0.5  # the sample standard deviation
    for step, trajectories in enumerate(consumed):
        assert len(trajectories) == B * N
        groups: dict[str, list] = {}
        for t in trajectories:
            groups.setdefault(t.group_id, []).append(t)
            assert t.metadata["reward_pool"] == {"n": 2 * N, "mean": pytest.approx(mean), "std": pytest.approx(std)}
            assert t.loss_mask.tolist() == [0] * t.prompt_len + [1] * (t.num_tokens - t.prompt_len)
        assert sorted(sum(t.reward for t in g) for g in groups.values()) == [1.0] * B  # the rescued episode kept
        # against the pool's mean 1/(2N) (and, for grpo, its spread), not the kept group's
        for advantage, scale in (("dr_grpo", 1.0), ("grpo", std + LossConfig().adv_eps)):
            batch = prepare_rl(trajectories, current_version=step, cfg=LossConfig(advantage=advantage))
            expected = [-mean / scale] * (N - 1) * B + [(1 - mean) / scale] * B
            assert sorted(s.advantage for s in batch.samples) == pytest.approx(sorted(expected), rel=1e-5)
