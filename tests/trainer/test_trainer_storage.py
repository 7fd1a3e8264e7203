"""Published weight folders are written without fsync; a resume checks them with ``intact_hf_folder``."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from agentrl.trainer.storage import intact_hf_folder, publish_dir


def _folder(path, n=1000):
    path.mkdir()
    save_file({"w": torch.arange(n, dtype=torch.float32), "b": torch.ones(3)}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


def test_a_whole_folder_is_intact(tmp_path):
    assert intact_hf_folder(_folder(tmp_path / "v1"))


def test_a_cut_file_a_garbage_header_or_a_missing_config_is_not(tmp_path):
    cut = _folder(tmp_path / "cut")
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:-100])
    assert not intact_hf_folder(cut)
    zeros = _folder(tmp_path / "zeros")
    (zeros / "model.safetensors").write_bytes(b"\0" * len(data))  # what a lost page cache can leave
    assert not intact_hf_folder(zeros)
    noconf = _folder(tmp_path / "noconf")
    (noconf / "config.json").unlink()
    assert not intact_hf_folder(noconf)
    assert not intact_hf_folder(tmp_path / "missing")


def test_publish_without_fsync_still_replaces_atomically(tmp_path):
    target = _folder(tmp_path / "v2")
    tmp = _folder(tmp_path / ".v2.partial", n=10)
    publish_dir(tmp, target, durable=False)
    assert not tmp.exists() and intact_hf_folder(target)
    assert (target / "model.safetensors").stat().st_size < 1000
