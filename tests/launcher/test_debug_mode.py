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
    # one process (rollout and trainer thread in it) and its embedded Redis; the SGLang server is not the run's
    per = summary["memory"]["per_process"]
    assert set(per) <= {"driver", "redis", "rollout_subprocesses"} and per["driver"] > 0.1 and per["redis"] > 0, per


def test_a_run_with_distributed_weight_sync_writes_no_weights_and_serves_every_version(tmp_path: Path,
                                                                                      shared_server: str) -> None:
    """weight_sync: distributed end to end (SFT's v0 and each RL version broadcast from the trainer's memory over a
    gloo group with the real server): the run writes no weights/v<N> for RL versions but the last, after the
    server has loaded it (the run's model; a server restarted once the trainer has ended loads it), and the server
    ends on the last one."""
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
    # SFT's output and the final version: the other RL versions stayed in memory
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["v0", "v2"]
    log = proc.stderr
    assert "a SGLang server restarted from now on loads v2 from" in log, log[-3000:]
    for v in (0, 1, 2):
        assert f"weights v{v} broadcast to 1 server(s)" in log, log[-3000:]
    assert "the rollout side serves v2; stopping" in log, log[-3000:]  # it waited for the last load

    async def served() -> int:
        async with SGLangClient(shared_server) as client:
            return await client.weight_version()

    assert asyncio.run(served()) == 2


def test_a_lora_run_serves_merged_weights_that_change_each_version(tmp_path: Path, shared_server: str,
                                                                   tiny_model_path: Path) -> None:
    """trainer.lora end to end (cold-start SFT with adapters, two RL steps, disk weight sync into the real server):
    every published version is a full checkpoint under the base model's names, the weights move version to
    version, the server ends on the last one, and the checkpoint holds the adapters alone."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from agentrl.launcher.config import load_config

    config = {
        "name": "lora", "model": "tiny", "steps": 2, "runs_dir": str(tmp_path / "runs"),
        "engine": {"url": shared_server},
        "sft": {"enabled": True, "steps": 2, "num_traces": 8, "batch_size": 4, "lr": 1e-2},
        "rollout": {"n_samples": 2, "groups_per_step": 2, "max_new_tokens": 16, "max_turns": 2,
                    "max_response_tokens": 48, "max_context_tokens": 192},
        # the tiny model's rewards are all alike (zero advantages): the entropy bonus gives every step a gradient
        "trainer": {"micro_batch_tokens": 2048, "optimizer": {"lr": 1e-2},
                    "loss": {"kl_coef": 0.05, "entropy_coef": 0.01},
                    "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}},
        "monitor": {"live": False, "prometheus_port": None, "tensorboard": False},
    }
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-c", NO_RAY, "train", str(path), "--debug"], capture_output=True,
                          text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run = tmp_path / "runs" / "lora"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_weight_version"] == 2 and summary["books_balanced"]
    base = load_file(str(tiny_model_path / "model.safetensors"))
    versions = [load_file(str(run / "weights" / f"v{v}" / "model.safetensors")) for v in (0, 1, 2)]
    for sd in versions:
        assert set(sd) == set(base)  # merged: no lora_ tensors, no base_layer. names
    # v0 (SFT's output, the RL trainer's start) stays fp32; RL versions are written in the dtype the engine serves
    # (an external server: the run does not know its dtype, so fp32; tests/launcher/test_trainer_process.py: bf16)
    assert load_config(run / "config.yaml").engine.server.dtype == "auto"
    assert [{t.dtype for t in sd.values()} for sd in versions] == [{torch.float32}] * 3
    # compared in bf16: a trainer computing in bf16 (dtype auto on a CPU with fast bf16) holds its frozen base in
    # bf16, so what it publishes is the bf16 base + B A s, in fp32 (the untargeted weights: the bf16 base exactly)
    for v, (before, after) in enumerate(zip([base, *versions], versions)):
        changed = {k.rsplit(".", 2)[-2] for k in base
                   if not torch.equal(before[k].to(torch.bfloat16), after[k].to(torch.bfloat16))}
        assert changed == {"q_proj", "v_proj", "down_proj"}, f"v{v} against the one before: {changed} changed"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["weight_version"] for m in metrics] == [1, 2] and metrics[0]["kl"] == 0.0 and metrics[1]["kl"] > 0
    ckpt = max((run / "checkpoints").iterdir())
    keys = FileSystemReader(str(ckpt / "state")).read_metadata().state_dict_metadata
    assert {k for k in keys if k.startswith("model.")} and all(".lora_" in k for k in keys if k.startswith("model."))

    async def served() -> int:
        async with SGLangClient(shared_server) as client:
            return await client.weight_version()

    assert asyncio.run(served()) == 2


def test_a_run_with_tensor_weight_sync_serves_every_version_from_shared_memory(tmp_path: Path,
                                                                             shared_server: str) -> None:
    """weight_sync: tensor end to end (the server on the trainer's host loads SFT's v0 and each RL version from the
    trainer's shared memory): no weights/v<N> for RL versions (a fallback to disk would write them), every version
    offered in shared memory, the server ends on the last one (written to disk then, as the run's model)."""
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
    # SFT's output and the final version written after the last load: no fallback to disk
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["v0", "v2"]
    assert "final weights v2 written to" in proc.stderr, proc.stderr[-3000:]
    for v in (0, 1, 2):
        assert f"weights v{v} offered in shared memory to 1 server(s)" in proc.stderr, proc.stderr[-3000:]
    assert "the rollout side serves v2; stopping" in proc.stderr, proc.stderr[-3000:]  # it waited for the last load

    async def served() -> int:
        async with SGLangClient(shared_server) as client:
            return await client.weight_version()

    assert asyncio.run(served()) == 2

