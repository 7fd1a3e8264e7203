"""FSDP2 across processes: world size 2 (two processes, gloo) equals world size 1 on the same global batch;
a run killed after a checkpoint resumes in a new process with the same next step."""

from __future__ import annotations

import json
import multiprocessing as mp
import warnings
from pathlib import Path

import pytest
import torch.multiprocessing as tmp
from trainer_helpers import free_port, run_steps, run_with_checkpoint, share_before_any_trainer

STEPS = 3


def _run_world(world: int, cfg_json: str, out: Path) -> dict:
    try:
        tmp.spawn(run_steps, args=(world, free_port(), cfg_json, STEPS, str(out)), nprocs=world, join=True)
    except tmp.ProcessExitedException as exc:
        # Seen once (a fresh-clone CI run, 2026-11-26): rank 1 of the gloo pair aborted ("terminate called without an
        # active exception", SIGABRT) and 6 local reruns passed. An abort by a signal is retried once, with a
        # warning, so the flake stays visible; a crash that repeats fails, and every assertion runs on the rerun.
        # Open: find the C++ thread that outlives its owner (the process group's teardown is the suspect).
        if exc.signal_name != "SIGABRT":
            raise
        warnings.warn(f"world size {world}: a rank aborted ({exc}); retried once", stacklevel=1)
        out.unlink(missing_ok=True)
        tmp.spawn(run_steps, args=(world, free_port(), cfg_json, STEPS, str(out)), nprocs=world, join=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize("lora", [None, {"r": 3, "alpha": 6.0}], ids=["full", "lora"])  # r 3: uneven shards
def test_world_size_two_matches_world_size_one(tiny_config, tmp_path: Path, lora: dict | None) -> None:
    cfg = tiny_config(
        lora=lora,
        lr=1e-2,
        micro_batch_tokens=48,
        logits_chunk_tokens=8,  # several checkpointed head chunks per micro-batch, recomputed under FSDP2
        mini_batches=2,
        optimizer={"grad_clip": 0.05, "warmup_steps": 2},
        loss={
            "correction": "decoupled",
            "kl_coef": 0.05,
            "entropy_coef": 0.01,
            "loss_agg": "seq_mean_token_mean",
        },
    ).model_dump_json()
    one = _run_world(1, cfg, tmp_path / "w1.json")
    two = _run_world(2, cfg, tmp_path / "w2.json")
    assert (one["world"], two["world"]) == (1, 2)
    for a, b in zip(one["metrics"], two["metrics"]):
        assert a["weight_version"] == b["weight_version"]
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["kl"] == pytest.approx(a["kl"], abs=1e-6) and b["entropy"] == pytest.approx(
            a["entropy"], rel=1e-5
        )
        assert a["grad_norm"] > 0.05  # clipping was active, so the clipped update is compared too
    assert one["metrics"][-1]["kl"] > 1e-6  # the weights moved: a no-op trainer would not pass
    for a, b in zip(one["logprobs"], two["logprobs"]):
        assert b == pytest.approx(a, abs=2e-4)
    assert len(two["logprobs_one"]) == 1 and any(two["logprobs_one"][0])
    assert two["logprobs_one"][0] == pytest.approx(one["logprobs_one"][0], abs=2e-4)
    assert two["published"].keys() == one["published"].keys() and not any(".lora_" in k for k in one["published"])
    for k, a in one["published"].items():
        assert two["published"][k] == pytest.approx(a, rel=1e-4, abs=1e-3), k


def test_kill_and_resume_gives_the_same_next_step(tiny_config, tmp_path: Path) -> None:
    cfg = tiny_config(
        lr=1e-2,
        optimizer={"warmup_steps": 3, "schedule": "cosine", "total_steps": 10},
        loss={"correction": "decoupled"},
    ).model_dump_json()
    ckpt = tmp_path / "checkpoints" / "step_2"
    ctx = mp.get_context("spawn")
    results = {}
    for mode in ("full", "resume"):
        out = tmp_path / f"{mode}.json"
        p = ctx.Process(target=run_with_checkpoint, args=(cfg, str(ckpt), str(out), mode, free_port()))
        p.start()
        p.join(timeout=300)
        assert p.exitcode == (-9 if mode == "full" else 0), f"{mode} exited with {p.exitcode}"
        results[mode] = json.loads(out.read_text())
    full, resumed = results["full"], results["resume"]
    assert resumed["restored"] == {"step": 2, "weight_version": 2}
    assert resumed["extra"] == {"queue_position": "1700000000000-7", "consumed": 24}
    a, b = full["step3"], resumed["step3"]
    assert (a["step"], a["weight_version"]) == (b["step"], b["weight_version"]) == (3, 3)
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert b["lr"] == pytest.approx(a["lr"], rel=1e-9)
    assert resumed["rand"] == full["rand"]  # RNG state restored
    for x, y in zip(full["logprobs"], resumed["logprobs"]):
        assert y == pytest.approx(x, abs=1e-5)


def test_one_group_for_a_ranks_whole_job_shares_objects_before_any_trainer(tmp_path: Path) -> None:
    """The launcher's trainer job at world size 2: rank 1 receives what rank 0 read before a model exists (it
    raised 'the source rank passed None' when each Trainer made its own group)."""
    out = tmp_path / "shared"
    tmp.spawn(share_before_any_trainer, args=(2, free_port(), str(out)), nprocs=2, join=True)
    for rank in (0, 1):
        seen = json.loads(Path(f"{out}.{rank}").read_text())
        assert seen == {"got": {"from": "rank 0"}, "outer": True, "inner": False, "alive": True, "world": 2}
        assert json.loads(Path(f"{out}.{rank}.after").read_text()) is False  # destroyed by the one that made it
