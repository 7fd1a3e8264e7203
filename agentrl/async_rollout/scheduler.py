"""Continuous rollout: groups of episodes under a staleness bound, finished groups to the queue, new weights
loaded as the trainer publishes them.

Two tasks run side by side:

- the producer admits groups (``n_samples`` episodes of one task, kept together for GRPO) whenever
  :class:`StalenessManager` has capacity, and puts each finished group on the trajectory queue in one call;
- the weight follower awaits each new version in the registry and loads it into the engine, either draining
  (SGLang waits for in-flight requests) or interrupting (pause with abort → load → continue; aborted requests
  are resumed by the episode runner, so their tokens keep exact per-token versions).

A group whose episodes hit an infrastructure failure (engine or sandbox) is retried, then dropped and counted;
it is never queued with a made-up reward.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from agentrl.async_rollout.episode import EpisodeRunner
from agentrl.async_rollout.staleness import StalenessManager
from agentrl.env.base import Environment
from agentrl.errors import AgentRLError, InfrastructureError
from agentrl.types import FinishReason, Task, Trajectory

logger = logging.getLogger(__name__)


class TrajectorySink(Protocol):
    async def put(self, trajectories: Sequence[Trajectory]) -> Any: ...


class WeightSource(Protocol):
    async def wait_for(self, min_version: int, *, timeout_s: float) -> Any: ...  # -> .version, .path


class ReloadableEngine(Protocol):
    async def update_weights(self, path: str, version: int) -> None: ...
    async def pause(self, mode: str = "abort") -> None: ...
    async def resume(self) -> None: ...


@dataclass(frozen=True, slots=True)
class RolloutConfig:
    n_samples: int = 4  # episodes per task (a GRPO group)
    groups_per_step: int = 4  # groups the trainer consumes per step
    max_staleness: int = 1  # η
    max_running_groups: int = 8
    update_mode: Literal["drain", "interrupt"] = "interrupt"
    group_retries: int = 2
    drop_uniform_groups: bool = False  # dynamic sampling: drop groups whose rewards are all equal
    weight_wait_timeout_s: float = 3600.0


@dataclass
class RolloutStats:
    groups_queued: int = 0
    groups_failed: int = 0
    groups_filtered: int = 0
    trajectories_queued: int = 0
    model_tokens: int = 0
    versions_loaded: list[int] = field(default_factory=list)
    reload_s: list[float] = field(default_factory=list)
    started_at: float = field(default_factory=time.monotonic)


class RolloutScheduler:
    def __init__(self, *, runner: EpisodeRunner, engine: ReloadableEngine, make_env: Callable[[], Environment],
                 env_name: str, tasks: Iterator[Task], sink: TrajectorySink, weights: WeightSource,
                 config: RolloutConfig, initial_version: int = 0,
                 on_group: Callable[[list[Trajectory]], Awaitable[None]] | None = None) -> None:
        self.runner = runner
        self.engine = engine
        self.make_env = make_env
        self.env_name = env_name
        self.tasks = tasks
        self.sink = sink
        self.weights = weights
        self.config = config
        self.on_group = on_group
        self.version = initial_version
        self.gate = StalenessManager(groups_per_step=config.groups_per_step, max_staleness=config.max_staleness,
                                     max_running=config.max_running_groups, version=initial_version)
        self.stats = RolloutStats()
        self._queued = asyncio.Condition()

    async def run(self, *, total_groups: int, final_version: int) -> RolloutStats:
        """Produce ``total_groups`` groups, then keep loading weights until the engine serves ``final_version``."""
        async with asyncio.TaskGroup() as tg:
            follower = tg.create_task(self._follow_weights(final_version))
            await self._produce(total_groups, tg)
            await follower
        return self.stats

    async def _produce(self, total_groups: int, tg: asyncio.TaskGroup) -> None:
        pending: set[asyncio.Task[None]] = set()
        while self.gate.started < total_groups or self.gate.running:
            if self.gate.started >= total_groups:
                await asyncio.wait(pending)
                continue
            index = await self.gate.acquire()
            task = next(self.tasks)
            t = tg.create_task(self._run_group(task, index))
            pending.add(t)
            t.add_done_callback(pending.discard)
        if pending:
            await asyncio.wait(pending)

    async def _run_group(self, task: Task, index: int) -> None:
        group_id = f"{task.id}#{index}"
        for attempt in range(self.config.group_retries + 1):
            try:
                group = await self._episodes(task, group_id)
            except InfrastructureError as exc:
                logger.warning("group %s attempt %d failed: %s", group_id, attempt + 1, exc)
                continue
            if any(t.finish_reason is FinishReason.ERROR for t in group):
                logger.warning("group %s attempt %d: a reward could not be computed", group_id, attempt + 1)
                continue
            if self.config.drop_uniform_groups and len({t.reward for t in group}) == 1:
                self.stats.groups_filtered += 1
                await self.gate.release(requeue=True)
                return
            await self.sink.put(group)
            self.stats.groups_queued += 1
            self.stats.trajectories_queued += len(group)
            self.stats.model_tokens += sum(t.num_model_tokens for t in group)
            if self.on_group is not None:
                await self.on_group(group)
            await self.gate.release()
            return
        self.stats.groups_failed += 1
        logger.error("group %s dropped after %d attempts", group_id, self.config.group_retries + 1)
        await self.gate.release(requeue=True)

    async def _episodes(self, task: Task, group_id: str) -> list[Trajectory]:
        async def one() -> Trajectory:
            env = self.make_env()
            async with env:
                return await self.runner.run(env, task, env_name=self.env_name, group_id=group_id)

        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(one()) for _ in range(self.config.n_samples)]
        except* AgentRLError as eg:
            raise eg.exceptions[0] from None
        return [t.result() for t in tasks]

    async def _follow_weights(self, final_version: int) -> None:
        while self.version < final_version:
            wv = await self.weights.wait_for(self.version + 1, timeout_s=self.config.weight_wait_timeout_s)
            t0 = time.monotonic()
            if self.config.update_mode == "interrupt":
                await self.engine.pause("abort")
                try:
                    await self.engine.update_weights(str(wv.path), int(wv.version))
                finally:
                    await self.engine.resume()
            else:
                await self.engine.update_weights(str(wv.path), int(wv.version))
            self.version = int(wv.version)
            self.stats.versions_loaded.append(self.version)
            self.stats.reload_s.append(time.monotonic() - t0)
            logger.info("engine now serves weight version %d (%.2fs)", self.version, time.monotonic() - t0)
            await self.gate.set_version(self.version)
