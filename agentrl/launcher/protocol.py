"""The run protocol: where the rollout process and the trainer process of one run meet, and the rules both keep.

Both processes import this module and nothing of each other (it imports neither torch nor SGLang code):

- the Redis names of a run: the trajectory stream (:func:`stream_name`) and the weight registry
  (:func:`registry_namespace`);
- the stream's capacity (:func:`queue_capacity`): producers block past it, nothing is dropped;
- how the trainer consumes (:func:`read_groups`): ``groups_per_step`` complete groups per step, in queue order. The
  rollout scheduler's staleness guarantee (:mod:`agentrl.async_rollout.scheduler`) rests on exactly this rule.

One RL step of the trainer (:mod:`agentrl.launcher.trainer_process`, whose docstring states the exactly-once
argument) is: read complete groups → step (version k-1 → k) → export ``weights/v<k>`` → checkpoint (with the
entry ids) → ack those ids → publish v<k> in the registry. The rollout side loads each published version.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from agentrl.queue import TrajectoryQueue
from agentrl.queue.base import QueueEntry

if TYPE_CHECKING:
    from agentrl.launcher.config import RunConfig


def stream_name(run: str) -> str:
    return f"agentrl:{run}:trajectories"


def registry_namespace(run: str) -> str:
    return f"agentrl:{run}"


def queue_capacity(cfg: RunConfig, *, per_sample: int = 1) -> int:
    """Unacknowledged entries the stream may hold before producers block (backpressure, never drops): the
    ``checkpoint_every`` steps read but not yet acknowledged (acks wait for the checkpoint), plus η + 1 steps
    ahead. Any less and a trainer between checkpoints could wait for entries the blocked producers hold.
    ``per_sample``: trajectories one episode may queue (an agent episode's ``max_branches``; only the producer's
    capacity binds)."""
    r = cfg.rollout.scheduler
    return max(16, (cfg.checkpoint_every + r.max_staleness + 1) * r.groups_per_step * r.n_samples * per_sample)


async def read_groups(
    queue: TrajectoryQueue,
    *,
    groups: int,
    group_size: int,
    carry: dict[str, list[QueueEntry]],
    stop_after_s: float,
) -> list[QueueEntry]:
    """Read until ``groups`` complete groups are at hand: ``group_size`` entries of one group_id, or as many as its
    trajectories say (``metadata["group_size"]``: agent episodes yield one trajectory per token branch); entries of
    incomplete groups stay in ``carry`` for the next step (they remain pending, never acked early)."""
    deadline = time.monotonic() + stop_after_s
    while True:
        done = [g for g, es in carry.items() if len(es) >= es[0].trajectory.metadata.get("group_size", group_size)]
        if len(done) >= groups:
            picked: list[QueueEntry] = []
            for g in done[:groups]:
                picked += carry.pop(g)
            return picked
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {groups} complete groups arrived within {stop_after_s:.0f}s")
        for e in await queue.read(group_size * groups, timeout_s=5.0):
            carry.setdefault(e.trajectory.group_id, []).append(e)
