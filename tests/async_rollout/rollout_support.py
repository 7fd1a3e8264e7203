"""Fakes around the scheduler: a token-by-token simulated SGLang (per-token versions, the three pause modes), a
FIFO trainer that consumes ``groups_per_step`` groups per step exactly as
``agentrl.launcher.protocol.read_groups`` does and records the staleness of everything it consumes, and
single-turn environments."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agentrl.engine.base import EngineFinish, GenerateResult, SamplingParams
from agentrl.env.base import Environment, StepResult
from agentrl.rewards import RewardInput, RewardResult
from agentrl.types import Task, Trajectory


class SimEngine:
    """Generates ``max_new_tokens`` tokens, one per ``token_s(sticky_key)`` seconds; each token carries the version
    served when it was produced. ``pause("abort")`` ends requests in flight (finish ABORT, tokens so far);
    ``retract``/``in_place`` hold them; every request waits while paused."""

    def __init__(self, token_s: Callable[[str | None], float], version: int = 0) -> None:
        self.token_s = token_s
        self.version = version
        self.paused: str | None = None
        self._epoch = 0
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.loads: list[int] = []

    async def generate(self, ids: Sequence[int], sampling: SamplingParams, *, sticky_key=None) -> GenerateResult:
        epoch = self._epoch
        out: list[int] = []
        versions: list[int] = []
        dt = self.token_s(sticky_key)
        while len(out) < sampling.max_new_tokens:
            await self._resumed.wait()
            if self._epoch != epoch:
                return GenerateResult(out, [-1.0] * len(out), versions, EngineFinish.ABORT)
            await asyncio.sleep(dt)
            if self._epoch != epoch:
                return GenerateResult(out, [-1.0] * len(out), versions, EngineFinish.ABORT)
            if self.paused is None:
                out.append(100 + len(out))
                versions.append(self.version)
        return GenerateResult(out, [-1.0] * len(out), versions, EngineFinish.STOP)

    async def pause(self, mode: str = "abort") -> None:
        self.paused = mode
        self._resumed.clear()
        if mode == "abort":
            self._epoch += 1

    async def resume(self) -> None:
        self.paused = None
        self._resumed.set()

    async def update_weights(self, path: str, version: int) -> None:
        await asyncio.sleep(0.005)
        self.version = version
        self.loads.append(version)

    async def weight_version(self) -> int:
        return self.version

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class Published:
    version: int
    path: str


class SimRegistry:
    """``wait_for`` returns the latest version once it is >= the one asked for (as WeightRegistry does)."""

    def __init__(self, version: int = 0) -> None:
        self.latest = version
        self._changed = asyncio.Condition()

    async def publish(self, version: int) -> None:
        async with self._changed:
            self.latest = version
            self._changed.notify_all()

    async def wait_for(self, min_version: int, *, timeout_s: float) -> Published:
        async with asyncio.timeout(timeout_s):
            async with self._changed:
                await self._changed.wait_for(lambda: self.latest >= min_version)
        return Published(self.latest, f"/weights/v{self.latest}")


@dataclass
class FifoTrainer:
    """The trainer's consumption pattern: per step, the next ``groups_per_step`` groups in queue order; trains
    (sleeps), publishes version + 1. Records ``version − min token version`` of every trajectory it consumes."""

    groups_per_step: int
    registry: SimRegistry
    step_s: float = 0.01
    version: int = 0
    staleness: list[int] = field(default_factory=list)
    puts: list[list[Trajectory]] = field(default_factory=list)
    _queue: asyncio.Queue[list[Trajectory]] = field(default_factory=asyncio.Queue)

    async def put(self, trajectories: Sequence[Trajectory]) -> list[str]:
        group = list(trajectories)
        self.puts.append(group)
        self._queue.put_nowait(group)
        return [t.trajectory_id for t in group]

    async def run(self, steps: int) -> None:
        for _ in range(steps):
            batch = [await self._queue.get() for _ in range(self.groups_per_step)]
            self.staleness += [self.version - t.min_version for g in batch for t in g]
            await asyncio.sleep(self.step_s)
            self.version += 1
            await self.registry.publish(self.version)


class OneTurnEnv(Environment):
    """One model turn, no tools; the reward is ``reward(task)`` (random 0/1 by default)."""

    name = "one_turn"

    def __init__(self, reward: Callable[[Task], float] | None = None, seed: int | None = None) -> None:
        self.reward = reward
        self.rng = random.Random(seed)
        self.task: Task | None = None

    async def reset(self, task: Task):
        self.task = task
        return [{"role": "user", "content": task.prompt}]

    async def step(self, text: str) -> StepResult:
        return StepResult(None, True)

    async def score(self, response: RewardInput) -> RewardResult:
        assert self.task is not None
        if self.reward is not None:
            return RewardResult.scored(self.reward(self.task))
        return RewardResult.scored(float(self.rng.random() < 0.5))


def task_stream(prefix: str = "t"):
    i = 0
    while True:
        yield Task(id=f"{prefix}{i}", prompt=f"question {i}")
        i += 1


class LetterTurnsEnv(Environment):
    """Multi-turn without a real tool: a turn ends at the letter 'e' (frequent in random text) and gets a short
    text observation, until the turn budget ends the episode."""

    name = "letters"
    stop = ("e",)

    async def reset(self, task: Task):
        return [{"role": "user", "content": task.prompt}]

    async def step(self, text: str) -> StepResult:
        from agentrl.env.base import Observation

        return StepResult(Observation(text="\n[ok]\n"), False)

    async def score(self, response: RewardInput) -> RewardResult:
        return RewardResult.scored(float(len(response.text) % 2))
