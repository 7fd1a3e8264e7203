"""`agentrl train --debug`: the controller, the rollout side and the trainer in one process, without Ray (a real
SGLang server, Redis, sandbox and FSDP2 trainer at world size 1)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agentrl.engine.client import SGLangClient

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


def test_a_run_with_distributed_weight_sync_writes_no_weights_and_serves_every_version(tmp_path: Path,
                                                                                      shared_server: str) -> None:
    """weight_sync: distributed end to end (SFT's v0 and each RL version broadcast from the trainer's memory over a
    gloo group with the real server): the run writes no weights/v<N> for RL versions and the server ends on the
    last one."""
    config = {
        "name": "dist", "model": "tiny", "steps": 2, "runs_dir": str(tmp_path / "runs"),
        "engine": {"url": shared_server}, "weight_sync": {"mode": "distributed", "timeout_s": 60, "bucket_mb": 2},
        "sft": {"enabled": True, "steps": 1, "num_traces": 8, "batch_size": 4},
        "rollout": {"n_samples": 2, "groups_per_step": 2, "max_new_tokens": 16, "max_turns": 2,
                    "max_response_tokens": 48, "max_context_tokens": 192},
        "trainer": {"micro_batch_tokens": 2048},
        "monitor": {"live": False, "prometheus_port": None, "tensorboard": False},
    }
    path = tmp_path / "dist.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-c", NO_RAY, "train", str(path), "--debug"], capture_output=True,
                          text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run = tmp_path / "runs" / "dist"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_weight_version"] == 2 and summary["books_balanced"]
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["v0"]  # SFT's output only: RL versions stayed in memory
    log = proc.stderr
    for v in (0, 1, 2):
        assert f"weights v{v} broadcast to 1 server(s)" in log, log[-3000:]

    async def served() -> int:
        async with SGLangClient(shared_server) as client:
            return await client.weight_version()

    assert asyncio.run(served()) == 2


def test_a_run_with_tensor_weight_sync_serves_every_version_from_shared_memory(tmp_path: Path,
                                                                             shared_server: str) -> None:
    """weight_sync: tensor end to end (the server on the trainer's host loads SFT's v0 and each RL version from the
    trainer's shared memory): no weights/v<N> for RL versions (a fallback to disk would write them), every version
    offered in shared memory, the server ends on the last one."""
    config = {
        "name": "shm", "model": "tiny", "steps": 2, "runs_dir": str(tmp_path / "runs"),
        "engine": {"url": shared_server}, "weight_sync": {"mode": "tensor", "timeout_s": 60},
        "sft": {"enabled": True, "steps": 1, "num_traces": 8, "batch_size": 4},
        "rollout": {"n_samples": 2, "groups_per_step": 2, "max_new_tokens": 16, "max_turns": 2,
                    "max_response_tokens": 48, "max_context_tokens": 192},
        "trainer": {"micro_batch_tokens": 2048},
        "monitor": {"live": False, "prometheus_port": None, "tensorboard": False},
    }
    path = tmp_path / "shm.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-c", NO_RAY, "train", str(path), "--debug"], capture_output=True,
                          text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run = tmp_path / "runs" / "shm"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_weight_version"] == 2 and summary["books_balanced"]
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["v0"]  # SFT's output only: no fallback to disk
    for v in (0, 1, 2):
        assert f"weights v{v} offered in shared memory to 1 server(s)" in proc.stderr, proc.stderr[-3000:]

    async def served() -> int:
        async with SGLangClient(shared_server) as client:
            return await client.weight_version()

    assert asyncio.run(served()) == 2
