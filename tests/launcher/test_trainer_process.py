"""The trainer process's disk retention: old published weight versions are deleted; v0 and the newest stay."""

from __future__ import annotations

from agentrl.launcher.config import RunConfig
from agentrl.launcher.trainer_process import prune_weight_versions


def test_prune_weight_versions_keeps_v0_and_the_window(tmp_path):
    for v in range(0, 9):
        (tmp_path / "weights" / f"v{v}").mkdir(parents=True)
    (tmp_path / "weights" / ".v9.partial").mkdir()
    prune_weight_versions(RunConfig(keep_weight_versions=3), tmp_path, latest=8)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [".v9.partial", "v0", "v6", "v7", "v8"]
    prune_weight_versions(RunConfig(keep_weight_versions=None), tmp_path, latest=20)  # null keeps everything
    assert len(list((tmp_path / "weights").iterdir())) == 5
