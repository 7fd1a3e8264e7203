"""Continuous rollout: groups of episodes under a staleness bound, finished groups to the queue, new weights
loaded as the trainer publishes them.

Two tasks run side by side:

- the producer admits groups (``n_samples`` episodes of one task, kept together for GRPO) whenever
  :class:`StalenessManager` has capacity, and puts each finished group on the trajectory queue in one call;
- the weight follower awaits each new version in the registry and loads it into the engine (``update_mode``):
  ``drain`` (SGLang finishes in-flight requests, then loads), ``interrupt`` (pause → load → continue; with
  ``pause_mode`` ``retract``/``in_place`` SGLang continues the requests on the new weights, with ``abort`` the
  episode runner resumes them; either way a turn keeps exact per-token versions), or ``abort_restart``
  (in-flight episodes are thrown away and restarted from scratch on the new weights).

**Staleness guarantee.** The trainer (the run protocol, ``agentrl.launcher.protocol.read_groups``) consumes
``groups_per_step`` complete groups per step in queue order, so the k-th group this scheduler queues
(k = 0, 1, …) is trained by the policy of version ``initial_version + k // groups_per_step``. A group is put on the queue only if

    initial_version + k // groups_per_step − min(weight version of its model tokens) ≤ η

so NO queued trajectory is more than η versions stale when the trainer consumes it. Admission (AReaL's rule,
see :mod:`staleness`) makes this hold for every group that finishes in time; for slow ones, after each weight
load the in-flight episodes that can no longer make it are restarted at once (and a finished group that fails
the check is restarted), up to ``max_stale_restarts`` times, then dropped and counted. Assumes one scheduler
feeding the queue and a trainer that starts at ``initial_version`` with the queue empty.

An episode may yield several trajectories (an agent episode: one per token branch, see :mod:`agent_episode`);
a group then holds more than ``n_samples``, and its trajectories say how many (``metadata["group_size"]``), which
is how the trainer knows it is complete (:func:`agentrl.launcher.protocol.read_groups`).

A group whose episodes hit an infrastructure failure (an :class:`InfrastructureError` from the engine, the sandbox,
or a reward that could not be computed) is retried whole, then dropped and counted; it is never queued with a
made-up reward.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentrl.async_rollout.config import RolloutConfig
from agentrl.async_rollout.curriculum import solved, task_key
from agentrl.async_rollout.staleness import StalenessManager
from agentrl.env.agent import AgentEnv
from agentrl.env.base import Environment
from agentrl.errors import AgentRLError, InfrastructureError
from agentrl.types import Task, Trajectory

logger = logging.getLogger(__name__)

class Runner(Protocol):
    """Runs one episode of an environment: an :class:`EpisodeRunner`, or an ``AgentRunner`` for agents."""

    async def episode(self, env: Any, task: Task, *, env_name: str = "", group_id: str = "") -> list[Trajectory]: ...


class TrajectorySink(Protocol):
    async def put(self, trajectories: Sequence[Trajectory]) -> Any: ...


class WeightSource(Protocol):
    async def wait_for(self, min_version: int, *, timeout_s: float) -> Any: ...  # -> .version, .path


class ReloadableEngine(Protocol):
    async def update_weights(self, path: str, version: int) -> None: ...
    async def pause(self, mode: Any = "abort") -> None: ...
    async def resume(self) -> None: ...


@dataclass
class RolloutStats:
    groups_queued: int = 0
    groups_failed: int = 0  # infrastructure failures after all retries
    groups_filtered: int = 0  # dynamic sampling
    groups_uniform_queued: int = 0  # uniform groups queued because the dropping budget was spent
    # adaptive sampling (resample_unsolved): extra rounds run, and groups a later round found a solved episode for
    resample_rounds: int = 0
    groups_rescued: int = 0
    groups_resample_denied: int = 0  # unsolved groups refused (more) rounds because the dropping budget was spent
    groups_dropped_stale: int = 0  # still over η after max_stale_restarts
    groups_restarted_stale: int = 0
    episodes_restarted: int = 0  # abort_restart, or could no longer finish within η
    trajectories_queued: int = 0
    model_tokens: int = 0  # model tokens of the queued trajectories
    generated_tokens: int = 0  # model tokens of every finished episode, also those of groups filtered or dropped
    staleness_max: int = 0  # over queued groups: consuming version − oldest token version
    # every finished group, queued or dropped by dynamic sampling, by the newest version among its tokens:
    # [episodes solved, episodes] (the trained groups alone are ~half solved by construction)
    solved_by_version: dict[int, list[int]] = field(default_factory=dict)
    # the same by task key (a generated problem's wording, else the prompt: curriculum.task_key): [episodes solved,
    # episodes, first version that solved one (-1: none yet)]. A key RL never solves, or solves late, is where
    # exploration failed: no group of it carried a signal (the demo's failed seeds: one wording at 0 for 25 versions)
    # Bounded: the first KEYS_TRACKED keys (a dataset's prompts are keys: their text is kept); groups of later new keys
    # are counted in groups_untracked_key only
    solved_by_key: dict[str, list[int]] = field(default_factory=dict)
    groups_untracked_key: int = 0
    versions_loaded: list[int] = field(default_factory=list)
    reload_s: list[float] = field(default_factory=list)
    started_at: float = field(default_factory=time.monotonic)


#: task keys whose outcomes RolloutStats.solved_by_key keeps (their text included): ~4 MB for prompts of 1 KB
KEYS_TRACKED = 4096

Episode = list[Trajectory]  # one episode's trajectories (an agent episode: one per token branch)


def _balanced(pool: list[Episode], size: int) -> list[Episode]:
    """``size`` episodes of an adaptively sampled pool, solved and unsolved ones as even as the pool allows
    (Reinforce-Ada-balance), the newest first within each (the least stale; the later round first among equals);
    each trajectory kept carries the whole pool's reward statistics (``metadata["reward_pool"]``), which its advantage
    is taken against (Reinforce-Ada's global baseline: the pool estimates the prompt's pass rate better than the
    kept few). Episodes are kept or cut whole: an agent episode's branches share tokens trained on one of them."""
    order = sorted((i for i, e in enumerate(pool) if e), key=lambda i: (min(t.min_version for t in pool[i]), i),
                   reverse=True)
    good: list[Episode] = []
    bad: list[Episode] = []
    for i in order:
        (good if any(map(solved, pool[i])) else bad).append(pool[i])
    n_good = min(len(good), max(size // 2, size - len(bad), 1 if good else 0))
    kept = good[:n_good] + bad[: size - n_good]
    rewards = [float(t.reward) for e in pool for t in e]
    stats = {"n": len(rewards), "mean": statistics.fmean(rewards),
             "std": statistics.stdev(rewards) if len(rewards) > 1 else 0.0}
    for e in kept:
        for t in e:
            t.metadata["reward_pool"] = dict(stats)
    return kept


def _flat(episodes: list[Episode]) -> list[Trajectory]:
    return [t for e in episodes for t in e]


class _StaleGroup(Exception):
    """A finished group would be consumed more than η versions after its oldest token."""


@dataclass(eq=False)
class _Attempt:
    """One try at one episode; restarted (cancelled and run again) when it cannot meet the bound."""

    task: asyncio.Task[list[Trajectory]]
    start_version: int  # the engine served at least this version when it started: a floor of its tokens'


class RolloutScheduler:
    def __init__(self, *, runner: Runner, engine: ReloadableEngine, make_env: Callable[[], Environment | AgentEnv],
                 env_name: str, tasks: Iterator[Task], sink: TrajectorySink, weights: WeightSource,
                 config: RolloutConfig, initial_version: int = 0,
                 on_group: Callable[[list[Trajectory]], Awaitable[None]] | None = None,
                 load_weights: Callable[[Any], Awaitable[int]] | None = None) -> None:
        """``load_weights(wv)`` brings the engine to a published version and returns the version it now serves
        (the rollout process's loader knows every transport: a folder, a broadcast); by default the engine loads
        ``wv.path`` as ``wv.version``."""
        self.runner = runner
        self.engine = engine
        self.make_env = make_env
        self.env_name = env_name
        self.tasks = tasks
        self.sink = sink
        self.weights = weights
        self.config = config
        self.on_group = on_group
        self.load_weights = load_weights or self._from_path
        self.version = initial_version
        self.initial_version = initial_version
        self.total_groups: int | None = None  # set by run()
        self.gate = StalenessManager(groups_per_step=config.groups_per_step, max_staleness=config.max_staleness,
                                     max_running=config.max_running_groups, version=initial_version)
        self.stats = RolloutStats()
        self._put_lock = asyncio.Lock()
        self._attempts: set[_Attempt] = set()
        self._seq = itertools.count()

    def consume_version(self, slot: int) -> int:
        """The trainer version that trains the ``slot``-th queued group (see the module docstring)."""
        return self.initial_version + slot // self.config.groups_per_step

    async def run(self, *, total_groups: int, final_version: int) -> RolloutStats:
        """Produce ``total_groups`` groups, then keep loading weights until the engine serves ``final_version``.
        Raises the first agentrl error that stopped it (e.g. the engine kept failing), not an exception group."""
        self.total_groups = total_groups
        try:
            async with asyncio.TaskGroup() as tg:
                follower = tg.create_task(self._follow_weights(final_version))
                await self._produce(total_groups, tg)
                await follower
        except* AgentRLError as eg:
            raise eg.exceptions[0] from None
        return self.stats

    async def _produce(self, total_groups: int, tg: asyncio.TaskGroup) -> None:
        # gate.started = groups queued + groups running (a dropped group gives its admission back)
        pending: set[asyncio.Task[None]] = set()
        while self.gate.started < total_groups or self.gate.running:
            if self.stats.groups_failed > self.config.max_failed_groups:
                raise InfrastructureError(
                    f"{self.stats.groups_failed} groups failed after {self.config.group_retries} retries each; "
                    "the engine or the sandbox keeps failing (see the warnings above)")
            if self.gate.started >= total_groups:
                await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                continue
            await self.gate.acquire()
            t = tg.create_task(self._run_group(next(self.tasks)))
            pending.add(t)
            t.add_done_callback(pending.discard)

    async def _run_group(self, task: Task) -> None:
        group_id = f"{task.id}#{next(self._seq)}"
        failures = stale = 0
        while failures <= self.config.group_retries and stale <= self.config.max_stale_restarts:
            try:
                episodes = await self._episodes(task, group_id)
                self._observe(task, _flat(episodes))  # the first round only: an unbiased pass rate
                pool, rounds = await self._resample(task, group_id, episodes)
                group = self._sized(_flat(episodes if len(pool) == len(episodes) else _balanced(pool, len(episodes))))
                uniform = self.config.drop_uniform_groups and len({t.reward for t in _flat(pool)}) == 1
                if uniform and self._may_drop():
                    self.stats.groups_filtered += 1
                    self._count_rounds(pool, rounds)
                    return await self.gate.release(requeue=True)
                await self._queue(group)
                self._count_rounds(pool, rounds)
                self.stats.groups_uniform_queued += uniform
                return await self.gate.release()
            except _StaleGroup as exc:
                stale += 1
                self.stats.groups_restarted_stale += 1
                logger.info("group %s restarts: %s", group_id, exc)
            except InfrastructureError as exc:
                failures += 1
                logger.warning("group %s attempt %d failed: %s", group_id, failures, exc)
        if stale > self.config.max_stale_restarts:
            self.stats.groups_dropped_stale += 1
            logger.warning("group %s dropped: still over the staleness bound after %d restarts", group_id, stale - 1)
        else:
            self.stats.groups_failed += 1
            logger.error("group %s dropped after %d failed attempts", group_id, failures)
        await self.gate.release(requeue=True)

    def _may_drop(self) -> bool:
        """Within the budget of rollout groups not queued: groups dropped plus extra rounds of adaptive sampling."""
        budget = self.config.max_dropped_per_queued
        spent = self.stats.groups_filtered + self.stats.resample_rounds
        return budget is None or spent < budget * (self.stats.groups_queued + 1)

    async def _resample(self, task: Task, group_id: str, pool: list[Episode]) -> tuple[list[Episode], int]:
        """Adaptive sampling (Reinforce-Ada's rounds): while no episode of the task's pool solved it, run another
        round of ``n_samples`` episodes, at most ``resample_unsolved`` rounds and within the dropping budget. A group
        of all-wrong answers has no signal toward the right one (at most the format reward's), and a hard prompt
        that 8 samples miss is often solved by the next 8; those are the groups RL learns most from. Returns the
        pool and the rounds run."""
        rounds = 0
        while rounds < self.config.resample_unsolved and not any(map(solved, _flat(pool))) and self._may_drop():
            rounds += 1
            self.stats.resample_rounds += 1
            pool = pool + await self._episodes(task, group_id)
        return pool, rounds

    def _count_rounds(self, pool: list[Episode], rounds: int) -> None:
        """Adaptive sampling's outcome, counted once the group is queued or dropped (not per stale restart)."""
        if self.config.resample_unsolved:
            unsolved = not any(map(solved, _flat(pool)))
            self.stats.groups_rescued += rounds > 0 and not unsolved
            self.stats.groups_resample_denied += unsolved and rounds < self.config.resample_unsolved

    def _sized(self, group: list[Trajectory]) -> list[Trajectory]:
        """Say the group's size on its trajectories where it is not ``n_samples`` (see the module docstring)."""
        for t in group:
            if len(group) == self.config.n_samples:
                t.metadata.pop("group_size", None)
            else:
                t.metadata["group_size"] = len(group)
        return group

    def _observe(self, task: Task, group: list[Trajectory]) -> None:
        versions = [t.weight_versions[t.loss_mask.astype(bool)].max() for t in group if t.num_model_tokens]
        version = int(max(versions)) if versions else self.version
        n_solved = sum(map(solved, group))
        counts = self.stats.solved_by_version.setdefault(version, [0, 0])
        counts[0] += n_solved
        counts[1] += len(group)
        key = task_key(task)
        by_key = self.stats.solved_by_key.get(key)
        if by_key is None and len(self.stats.solved_by_key) >= KEYS_TRACKED:
            self.stats.groups_untracked_key += 1
        else:
            by_key = self.stats.solved_by_key.setdefault(key, [0, 0, -1])
            by_key[0] += n_solved
            by_key[1] += len(group)
            if n_solved and (by_key[2] < 0 or version < by_key[2]):
                by_key[2] = version
        observe = getattr(self.tasks, "observe", None)  # e.g. SkipSolved
        if observe is not None:
            observe(task, group)

    async def _episodes(self, task: Task, group_id: str) -> list[Episode]:
        """A round: ``n_samples`` episodes of the task, run together."""
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._episode(task, group_id)) for _ in range(self.config.n_samples)]
        except* AgentRLError as eg:
            raise eg.exceptions[0] from None
        return [t.result() for t in tasks]

    async def _episode(self, task: Task, group_id: str) -> list[Trajectory]:
        """Run one episode; run it again from scratch whenever the weight follower restarts it."""
        while True:
            attempt = _Attempt(asyncio.ensure_future(self._one(task, group_id)), self.version)
            self._attempts.add(attempt)
            try:
                trajectories = await attempt.task
                self.stats.generated_tokens += sum(t.num_model_tokens for t in trajectories)
                return trajectories
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # we are being cancelled ourselves
                self.stats.episodes_restarted += 1
            finally:
                self._attempts.discard(attempt)

    async def _one(self, task: Task, group_id: str) -> list[Trajectory]:
        async with self.make_env() as env:
            return await self.runner.episode(env, task, env_name=self.env_name, group_id=group_id)

    async def _queue(self, group: list[Trajectory]) -> None:
        """Put the group in the next queue slot if that keeps it within η; else raise :class:`_StaleGroup`."""
        versions = [t.min_version for t in group if t.num_model_tokens]
        async with self._put_lock:
            slot = self.stats.groups_queued
            staleness = self.consume_version(slot) - min(versions) if versions else 0
            if staleness > self.config.max_staleness:
                raise _StaleGroup(f"it would be trained {staleness} versions after its oldest token "
                                  f"(η = {self.config.max_staleness})")
            await self.sink.put(group)
            self.stats.groups_queued += 1
            self.stats.staleness_max = max(self.stats.staleness_max, staleness)
        self.stats.trajectories_queued += len(group)
        self.stats.model_tokens += sum(t.num_model_tokens for t in group)
        if self.on_group is not None:
            await self.on_group(group)

    def _restart(self, should: Callable[[_Attempt], bool]) -> int:
        """Cancel the in-flight attempts ``should`` picks; their episodes start again from scratch."""
        picked = [a for a in self._attempts if should(a) and not a.task.done()]
        for a in picked:
            a.task.cancel()
        return len(picked)

    def _doomed(self, attempt: _Attempt) -> bool:
        """True if the episode's group can no longer be queued within η (its oldest token ≥ start_version)."""
        next_slot = self.stats.groups_queued
        return self.consume_version(next_slot) - attempt.start_version > self.config.max_staleness

    async def _follow_weights(self, final_version: int) -> None:
        while self.version < final_version:
            wv = await self.weights.wait_for(self.version + 1, timeout_s=self.config.weight_wait_timeout_s)
            await self._load(wv)

    async def _from_path(self, wv: Any) -> int:
        await self.engine.update_weights(str(wv.path), int(wv.version))
        return int(wv.version)

    async def _load(self, wv: Any) -> None:
        t0 = time.monotonic()
        mode = self.config.update_mode
        if mode == "drain":
            self.version = version = await self.load_weights(wv)
        else:
            await self.engine.pause("abort" if mode == "abort_restart" else self.config.pause_mode)
            try:
                self.version = version = await self.load_weights(wv)
                if mode == "abort_restart":  # restarted episodes wait on the paused server for the resume
                    self._restart(lambda a: a.start_version < version)
            finally:
                await self.engine.resume()
        restarted = self._restart(self._doomed)
        if restarted:
            logger.info("restarted %d episodes that could no longer finish within η", restarted)
        self.stats.versions_loaded.append(version)
        self.stats.reload_s.append(time.monotonic() - t0)
        logger.info("engine now serves weight version %d (%.2fs, %s)", version, time.monotonic() - t0, mode)
        await self.gate.set_version(version)
