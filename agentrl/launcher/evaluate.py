"""Held-out evaluation during a run: greedy episodes on fixed tasks, accuracy and reward."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agentrl.async_rollout.episode import EpisodeRunner
from agentrl.env.base import Environment
from agentrl.types import Task, Trajectory


@dataclass(frozen=True, slots=True)
class EvalOutcome:
    n: int
    accuracy: float  # share of episodes whose answer is correct (reward breakdown "correct" == 1)
    reward_mean: float
    turns_mean: float
    tool_calls_mean: float
    errors: int  # episodes that failed for infrastructure reasons (not counted in the means)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def is_correct(t: Trajectory) -> bool:
    """Correctness of an episode: the ``correct`` component of its reward if it has one, else reward ≥ 1."""
    if "correct" in t.reward_breakdown:
        return t.reward_breakdown["correct"] >= 1.0
    return t.reward >= 1.0


async def evaluate(runner: EpisodeRunner, make_env: Callable[[], Environment], tasks: Sequence[Task], *,
                   concurrency: int, env_name: str, out: Path | None = None) -> EvalOutcome:
    """Run one episode per task (bounded concurrency); infrastructure failures are counted, not scored."""
    gate = asyncio.Semaphore(max(1, concurrency))
    results: list[Trajectory | BaseException] = []

    async def one(task: Task) -> Trajectory | BaseException:
        async with gate:
            try:
                env = make_env()
                async with env:
                    return await runner.run(env, task, env_name=env_name, group_id=f"eval:{task.id}")
            except Exception as exc:  # an infrastructure failure of one sample must not sink the evaluation
                return exc

    results = list(await asyncio.gather(*(one(t) for t in tasks)))
    good = [r for r in results if isinstance(r, Trajectory)]
    if out is not None:
        with open(out, "w") as f:
            for task, r in zip(tasks, results):
                rec: dict[str, Any] = {"task_id": task.id, "prompt": task.prompt, "answer": task.answer}
                if isinstance(r, Trajectory):
                    rec |= {"correct": is_correct(r), "reward": r.reward, "finish_reason": r.finish_reason.value,
                            "turns": [u.text for u in r.turns],
                            "tools": [[x.output for x in u.tool_results] for u in r.turns]}
                else:
                    rec["error"] = repr(r)
                f.write(json.dumps(rec) + "\n")
    n = len(good)
    return EvalOutcome(
        n=n,
        accuracy=sum(is_correct(t) for t in good) / n if n else 0.0,
        reward_mean=sum(t.reward for t in good) / n if n else 0.0,
        turns_mean=sum(len(t.turns) for t in good) / n if n else 0.0,
        tool_calls_mean=sum(len(u.tool_calls) for t in good for u in t.turns) / n if n else 0.0,
        errors=len(results) - n,
    )
