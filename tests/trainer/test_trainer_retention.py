"""Disk retention of the trainer: old checkpoints are deleted, the newest completed ones stay."""

from __future__ import annotations

import json
import os

import pytest

from agentrl.trainer.storage import STATE_FILE, prune_checkpoints


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
