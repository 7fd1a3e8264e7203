"""Spend rollouts where the policy can still learn: skip prompts it has mastered.

With dynamic sampling (``drop_uniform_groups``) a group whose samples all succeed trains nothing, yet costs a full
group of rollouts. As the policy improves, most rollouts go to such groups (in the CPU demo 460 of 580 groups
were dropped). :class:`SkipSolved` wraps the task stream: it keeps, per prompt key (the prompt, or the wording
of a generated problem: ``metadata["template"]``), the outcomes of the key's last ``window`` groups, and a key
whose pass rate over them is at least ``threshold`` counts as mastered. A mastered key's next tasks are skipped,
except a ``keep`` fraction of them, which recheck it (a policy can unlearn). Keys the policy never solves are not
skipped: they are what RL is for, and one success in a group is a strong signal.

The scheduler reports every finished group (also the ones it drops) through :meth:`observe`.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterator, Sequence

from agentrl.errors import ConfigError
from agentrl.rewards.base import is_correct
from agentrl.types import Task, Trajectory


def task_key(task: Task) -> str:
    """What mastery is tracked by: a generated problem's wording, else the prompt itself."""
    template = task.metadata.get("template")
    return str(template) if template is not None else task.prompt


def solved(trajectory: Trajectory) -> bool:
    """An episode succeeded, by agentrl's one correctness rule (:func:`agentrl.rewards.base.is_correct`): its
    ``correct`` reward component is 1 (math, ReTool), or, for environments without one, its reward is at least 1."""
    return is_correct(trajectory.reward, trajectory.reward_breakdown)


class SkipSolved(Iterator[Task]):
    def __init__(self, tasks: Iterator[Task], *, window: int = 2, threshold: float = 1.0, keep: float = 0.25,
                 seed: int = 0, key: Callable[[Task], str] = task_key,
                 success: Callable[[Trajectory], bool] = solved) -> None:
        if window < 1:
            raise ConfigError(f"skip_solved window must be >= 1 group, got {window}")
        if not 0 < threshold <= 1:
            raise ConfigError(f"skip_solved threshold is a pass rate in (0, 1], got {threshold}")
        if not 0 < keep <= 1:
            # keep = 0 would never recheck a mastered key and could skip forever once every key is mastered
            raise ConfigError(f"skip_solved keep is a fraction in (0, 1], got {keep}")
        self.tasks = tasks
        self.window, self.threshold, self.keep = window, threshold, keep
        self.key, self.success = key, success
        self.skipped = 0
        self._rng = random.Random(f"skip-solved:{seed}")
        self._history: dict[str, deque[tuple[int, int]]] = {}

    def mastered(self, key: str) -> bool:
        history = self._history.get(key)
        if history is None or len(history) < self.window:
            return False
        return sum(s for s, _ in history) >= self.threshold * sum(n for _, n in history)

    def observe(self, task: Task, group: Sequence[Trajectory]) -> None:
        """Record a finished group of ``task`` (queued or dropped alike)."""
        if group:
            history = self._history.setdefault(self.key(task), deque(maxlen=self.window))
            history.append((sum(map(self.success, group)), len(group)))

    def __next__(self) -> Task:
        while True:
            task = next(self.tasks)
            if not self.mastered(self.key(task)) or self._rng.random() < self.keep:
                return task
            self.skipped += 1
