"""The trainer process: disk retention (old published weight versions are deleted; v0 and the newest stay) and the
dtype published versions are written in."""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("engine_dtype", ["bfloat16", "float32", "auto"])
def test_disk_versions_are_written_in_the_dtype_the_engine_serves(tiny_model_path, tmp_path, engine_dtype):
    """weight_sync disk: a published version is the trainer's weights cast as the server would cast them (half the
    bytes in bf16); an engine whose dtype the run does not know (``auto``: an external server) gets fp32."""
    import torch
    from safetensors.torch import load_file

    from agentrl.launcher.trainer_process import WeightShare
    from agentrl.trainer import Trainer, TrainerConfig

    cfg = RunConfig.model_validate({"engine": {"dtype": engine_dtype}})
    want = {"bfloat16": torch.bfloat16, "float32": torch.float32, "auto": torch.float32}[engine_dtype]
    with Trainer(TrainerConfig(model=str(tiny_model_path), dtype="fp32")) as tr:
        share = WeightShare(cfg, tmp_path, tr, None)
        share.share(1, tmp_path / "weights" / "v1")
        master = tr.full_state_dict()
    written = load_file(str(tmp_path / "weights" / "v1" / "model.safetensors"))
    assert {t.dtype for t in written.values()} == {want}
    for k, t in written.items():
        assert torch.equal(t, master[k].to(want)), k  # the same rounding as the server's own cast
