"""The run protocol: the queue leaves room for the steps read between checkpoints."""

from __future__ import annotations

from agentrl.launcher.config import RunConfig
from agentrl.launcher.protocol import queue_capacity


def test_queue_capacity_covers_the_steps_between_checkpoints():
    base = {"rollout": {"n_samples": 4, "groups_per_step": 4, "max_staleness": 1}}
    assert queue_capacity(RunConfig(**base)) == 3 * 16
    # five steps read and unacknowledged (acks wait for the checkpoint) plus η + 1 ahead
    assert queue_capacity(RunConfig(**base, checkpoint_every=5)) == 7 * 16
    # an agent episode may queue one trajectory per token branch
    assert queue_capacity(RunConfig(**base), per_sample=4) == 3 * 16 * 4


class _Queue:
    def __init__(self, entries):
        self.entries = list(entries)

    async def read(self, count, *, timeout_s):
        out, self.entries = self.entries[:count], self.entries[count:]
        return out


def _entry(i: int, group: str, size: int | None = None):
    import numpy as np

    from agentrl.queue.base import QueueEntry
    from agentrl.types import FinishReason, Trajectory

    meta = {} if size is None else {"group_size": size}
    return QueueEntry(f"{i}-0", Trajectory(
        trajectory_id=str(i), prompt_id="p", group_id=group, token_ids=np.array([1, 2]), prompt_len=1,
        loss_mask=np.array([0, 1]), behavior_logprobs=np.zeros(2), weight_versions=np.array([-1, 0]), reward=0.0,
        finish_reason=FinishReason.STOP, metadata=meta))


async def test_a_group_is_complete_at_the_size_its_trajectories_state():
    from agentrl.launcher.protocol import read_groups

    # group a: two episodes, one of them forked (3 trajectories); group b: the usual 2
    queue = _Queue([_entry(0, "a", 3), _entry(1, "b"), _entry(2, "a", 3), _entry(3, "b"), _entry(4, "a", 3)])
    carry: dict = {}
    first = await read_groups(queue, groups=1, group_size=2, carry=carry, stop_after_s=5)  # type: ignore[arg-type]
    assert [e.trajectory.group_id for e in first] == ["b", "b"]  # a had 2 of its 3 when b was complete
    second = await read_groups(queue, groups=1, group_size=2, carry=carry, stop_after_s=5)  # type: ignore[arg-type]
    assert [e.entry_id for e in second] == ["0-0", "2-0", "4-0"] and not carry
