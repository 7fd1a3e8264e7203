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


@pytest.mark.parametrize("mode", ["interrupt", "abort_restart"])
async def test_scheduler_with_sglang_redis_and_the_trainers_reader(sglang_url, redis_client, chat_tokenizer,
                                                                   tiny_model_path, mode):
    from agentrl.launcher.protocol import read_groups

    name = f"test:{uuid.uuid4().hex[:8]}"
    queue = TrajectoryQueue(redis_client, f"{name}:traj", consumer="trainer-0", capacity=64)
    registry = WeightRegistry(redis_client, name)
    async with SGLangClient(sglang_url) as client:
        await client.set_weight_version(0)
        await registry.publish(0, str(tiny_model_path), step=0)
        runner = EpisodeRunner(client, chat_tokenizer, SamplingParams(max_new_tokens=24, temperature=1.0),
                               EpisodeBudget(max_turns=1, max_response_tokens=24))
        scheduler = RolloutScheduler(
            runner=runner, engine=client, make_env=lambda: OneTurnEnv(), env_name="one", tasks=task_stream(),
            sink=queue, weights=registry,
            config=RolloutConfig(n_samples=N, groups_per_step=B, max_staleness=ETA, max_running_groups=3,
                                 update_mode=mode))
        consumed: list[tuple[int, list]] = []

        async def trainer() -> None:
            carry: dict = {}
            for version in range(STEPS):
                entries = await read_groups(queue, groups=B, group_size=N, carry=carry, stop_after_s=300)
                consumed.append((version, [e.trajectory for e in entries]))
                await queue.ack([e.entry_id for e in entries])
                await registry.publish(version + 1, str(tiny_model_path), step=version + 1)

        async with asyncio.timeout(600):
            train = asyncio.create_task(trainer())
            stats = await scheduler.run(total_groups=STEPS * B, final_version=STEPS)
            await train
        assert await client.weight_version() == STEPS
    await queue.aclose()
    await registry.aclose()

    assert [v for v, _ in consumed] == [0, 1, 2] and all(len(ts) == B * N for _, ts in consumed)
    for version, trajectories in consumed:
        for t in trajectories:
            assert version - t.min_version <= ETA
            assert t.num_model_tokens == 24 or t.token_ids[-1] == chat_tokenizer.eos_token_id
            assert t.loss_mask.tolist() == [0] * t.prompt_len + [1] * (t.num_tokens - t.prompt_len)
            assert t.generated_versions == sorted(t.generated_versions)
    assert stats.versions_loaded == [1, 2, 3] and stats.groups_queued == STEPS * B
