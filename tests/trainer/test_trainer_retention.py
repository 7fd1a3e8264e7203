"""Disk retention of a run: old checkpoints and old published weight versions are deleted; v0 and the newest stay;
the queue leaves room for the steps read between checkpoints."""

from __future__ import annotations

import json
import os

import pytest

from agentrl.launcher.config import RunConfig
from agentrl.trainer.storage import STATE_FILE, prune_checkpoints
from agentrl.trainer.worker import prune_weight_versions, queue_capacity


def _checkpoint(root, step):
    d = root / f"step-{step:06d}"
    d.mkdir(parents=True)
    (d / STATE_FILE).write_text(json.dumps({"step": step}))
    os.utime(d / STATE_FILE, ns=(step * 10**9, step * 10**9))  # completion order = step order
    return d


def test_prune_checkpoints_keeps_the_newest_completed_ones(tmp_path):
    for step in (1, 2, 3, 4):
        _checkpoint(tmp_path, step)
    (tmp_path / ".step-000005.partial").mkdir()  # a save in progress is not ours to delete
    deleted = prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in deleted) == ["step-000001", "step-000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step-000005.partial", "step-000003", "step-000004"]
    with pytest.raises(ValueError, match="keep"):
        prune_checkpoints(tmp_path, keep=0)


def test_prune_weight_versions_keeps_v0_and_the_window(tmp_path):
    for v in range(0, 9):
        (tmp_path / "weights" / f"v{v}").mkdir(parents=True)
    (tmp_path / "weights" / ".v9.partial").mkdir()
    prune_weight_versions(RunConfig(keep_weight_versions=3), tmp_path, latest=8)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [".v9.partial", "v0", "v6", "v7", "v8"]
    prune_weight_versions(RunConfig(keep_weight_versions=None), tmp_path, latest=20)  # null keeps everything
    assert len(list((tmp_path / "weights").iterdir())) == 5


def test_queue_capacity_covers_the_steps_between_checkpoints():
    base = {"rollout": {"n_samples": 4, "groups_per_step": 4, "max_staleness": 1}}
    assert queue_capacity(RunConfig(**base)) == 3 * 16
    # five steps read and unacknowledged (acks wait for the checkpoint) plus η + 1 ahead
    assert queue_capacity(RunConfig(**base, checkpoint_every=5)) == 7 * 16
