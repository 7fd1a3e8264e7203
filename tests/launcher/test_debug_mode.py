"""`agentrl train --debug`: the controller, the rollout side and the trainer in one process, without Ray (a real
SGLang server, Redis, sandbox and FSDP2 trainer at world size 1)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.sglang, pytest.mark.redis]  # the run starts its own embedded Redis

#: the command line with Ray unable to start: a run that placed anything on Ray would fail
NO_RAY = """
import ray

def refuse(*args, **kwargs):
    raise RuntimeError("debug mode started Ray")

ray.init = refuse
from agentrl.cli import app
app()
"""


def test_a_tiny_run_completes_in_one_process_without_ray(tmp_path: Path, shared_server: str) -> None:
    config = {
        "name": "debug", "model": "tiny", "steps": 1, "runs_dir": str(tmp_path / "runs"),
        "engine": {"url": shared_server}, "sft": {"enabled": False},
        "rollout": {"n_samples": 2, "groups_per_step": 2, "max_new_tokens": 16, "max_turns": 2,
                    "max_response_tokens": 48, "max_context_tokens": 192},
        "trainer": {"micro_batch_tokens": 2048},
        "monitor": {"live": False, "prometheus_port": None, "tensorboard": False},
    }
    path = tmp_path / "debug.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-c", NO_RAY, "train", str(path), "--debug"], capture_output=True,
                          text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run = tmp_path / "runs" / "debug"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_weight_version"] == 1 and summary["trajectories_consumed"] == 4 and summary["books_balanced"]
    assert yaml.safe_load((run / "config.yaml").read_text())["resources"]["ray"] is False
    assert (run / "weights" / "v1" / "config.json").exists()
