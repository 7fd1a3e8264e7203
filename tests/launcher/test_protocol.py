"""The run protocol: the queue leaves room for the steps read between checkpoints."""

from __future__ import annotations

from agentrl.launcher.config import RunConfig
from agentrl.launcher.protocol import queue_capacity


def test_queue_capacity_covers_the_steps_between_checkpoints():
    base = {"rollout": {"n_samples": 4, "groups_per_step": 4, "max_staleness": 1}}
    assert queue_capacity(RunConfig(**base)) == 3 * 16
    # five steps read and unacknowledged (acks wait for the checkpoint) plus η + 1 ahead
    assert queue_capacity(RunConfig(**base, checkpoint_every=5)) == 7 * 16
