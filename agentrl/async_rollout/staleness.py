"""Staleness-bounded admission of new rollout groups (AReaL-style).

The trainer's step k (1-based) trains policy version k-1 into version k on ``groups_per_step`` groups. A group
started while the engine serves version v is admitted only if it can be consumed no later than η versions after
v, i.e. if fewer than ``(η + v + 1) · groups_per_step`` groups have been started so far. Together with the
concurrency limit:

    capacity = min(max_running - running, (η + v + 1) · groups_per_step - started)

With η = 0 rollout and training strictly alternate (synchronous RL); larger η lets rollout run ahead.
A sample that still comes out staler than η (a slow episode) is the trainer's to drop or down-weight.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StalenessStats:
    version: int
    started: int
    running: int
    capacity: int


class StalenessManager:
    """Counts started/running groups and wakes waiters when capacity appears."""

    def __init__(self, *, groups_per_step: int, max_staleness: int, max_running: int, version: int = 0) -> None:
        if groups_per_step < 1 or max_staleness < 0 or max_running < 1:
            raise ValueError(
                f"expected groups_per_step >= 1, max_staleness >= 0, max_running >= 1; got {groups_per_step}, "
                f"{max_staleness}, {max_running}"
            )
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.max_running = max_running
        self.version = version
        self.started = 0
        self.running = 0
        self._changed = asyncio.Condition()
        # told whenever ``running`` or ``version`` changes (agentrl.launcher.cores)
        self.listeners: list[Callable[[], None]] = []

    def capacity(self) -> int:
        by_staleness = (self.max_staleness + self.version + 1) * self.groups_per_step - self.started
        return max(0, min(self.max_running - self.running, by_staleness))

    async def acquire(self) -> int:
        """Wait for capacity, then admit one group; returns its index (0, 1, 2, …)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.capacity() > 0)
            index = self.started
            self.started += 1
            self.running += 1
            self._tell()
            return index

    async def release(self, *, requeue: bool = False) -> None:
        """A group finished (or failed; ``requeue`` gives its admission back so it can be started again)."""
        async with self._changed:
            self.running -= 1
            if requeue:
                self.started -= 1
            self._changed.notify_all()
            self._tell()

    def _tell(self) -> None:
        for listener in self.listeners:
            listener()

    async def set_version(self, version: int) -> None:
        async with self._changed:
            self.version = max(self.version, version)
            self._changed.notify_all()
            self._tell()

    def stats(self) -> StalenessStats:
        return StalenessStats(self.version, self.started, self.running, self.capacity())
