"""The run directory policy: a used directory needs --resume or --overwrite; one run at a time per directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.errors import ConfigError
from agentrl.launcher.rundir import LOCK_FILE, RunDirLock, check_same_run, claim_run_dir, resume_point


def used_run(run_dir: Path, checkpoints: dict[int, int] | None = None) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("name: x\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    for step, version in (checkpoints or {}).items():
        ck = run_dir / "checkpoints" / f"step-{step:06d}"
        ck.mkdir(parents=True)
        (ck / "trainer_state.json").write_text(json.dumps(
            {"step": step, "weight_version": version, "extra": {"entry_ids": [f"{step}-0", f"{step}-1"]}}))
    (run_dir / "checkpoints" / "step-000099.partial").mkdir(parents=True)  # an unfinished one: ignored
    return run_dir


def test_a_fresh_directory_is_claimed(tmp_path: Path) -> None:
    lock, point = claim_run_dir(tmp_path / "new", resume=False, overwrite=False)
    assert point is None and (tmp_path / "new" / LOCK_FILE).exists()
    lock.close()


def test_a_used_directory_is_refused_without_a_flag(tmp_path: Path) -> None:
    run = used_run(tmp_path / "r", {5: 5})
    with pytest.raises(ConfigError, match=r"already holds a run \(its last checkpoint is step 5\).*--resume.*"
                                          r"--overwrite"):
        claim_run_dir(run, resume=False, overwrite=False)
    assert (run / "metrics.jsonl").exists()  # nothing touched
    claim_run_dir(run, resume=True, overwrite=False)[0].close()  # the refusal released its lock


def test_resume_finds_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    run = used_run(tmp_path / "r", {5: 5, 10: 10})
    lock, point = claim_run_dir(run, resume=True, overwrite=False)
    assert point is not None and (point.step, point.version, point.entry_ids) == (10, 10, ("10-0", "10-1"))
    lock.close()
    assert resume_point(used_run(tmp_path / "none")).step == 0


def test_resume_of_nothing_and_contradicting_flags_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="holds no run to resume"):
        claim_run_dir(tmp_path / "empty", resume=True, overwrite=False)
    with pytest.raises(ConfigError, match="contradict"):
        claim_run_dir(tmp_path / "empty", resume=True, overwrite=True)


def test_overwrite_clears_the_directory(tmp_path: Path) -> None:
    run = used_run(tmp_path / "r", {5: 5})
    lock, point = claim_run_dir(run, resume=False, overwrite=True)
    assert point is None and [p.name for p in run.iterdir()] == [LOCK_FILE]
    lock.close()


def test_a_directory_in_use_is_refused_even_with_a_flag(tmp_path: Path) -> None:
    run = used_run(tmp_path / "r", {5: 5})
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from agentrl.launcher.rundir import RunDirLock; "
        f"lock = RunDirLock(Path({str(run)!r})); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        for flags in ({"resume": True, "overwrite": False}, {"resume": False, "overwrite": True}):
            with pytest.raises(ConfigError, match=f"in use by a running agentrl run \\(pid {holder.pid}\\)"):
                claim_run_dir(run, **flags)
        assert (run / "metrics.jsonl").exists()  # --overwrite did not delete a live run's files
    finally:
        holder.kill()
        holder.wait()
    RunDirLock(run).close()  # released when its holder died


def test_a_resume_with_another_model_or_other_lora_settings_is_refused(tmp_path: Path, caplog) -> None:
    from agentrl.launcher import recipes
    from agentrl.launcher.config import load_config, save_config

    save_config(load_config(None, ["name=x"], base=recipes.DEMO_LORA), tmp_path / "config.yaml")
    # the same run with more steps and another rate: resumed
    check_same_run(tmp_path, load_config(None, ["name=x", "steps=40", "trainer.optimizer.lr=1e-4"],
                                         base=recipes.DEMO_LORA))
    with pytest.raises(ConfigError) as info:  # `agentrl demo --resume` without --lora
        check_same_run(tmp_path, load_config(None, ["name=x"], base=recipes.DEMO))
    text = str(info.value)
    assert "trainer.lora was {" in text and '"r": 16' in text and "now null" in text and "--lora" in text
    with pytest.raises(ConfigError, match=r"trainer.lora was .*\"r\": 16.*now .*\"r\": 8"):
        check_same_run(tmp_path, load_config(None, ["name=x", "trainer.lora.r=8"], base=recipes.DEMO_LORA))
    with pytest.raises(ConfigError, match='model was "smollm2-135m-instruct", now "tiny"') as info:
        check_same_run(tmp_path, load_config(None, ["name=x", "model=tiny"], base=recipes.DEMO_LORA))
    assert "trainer.lora" not in str(info.value)
    (tmp_path / "config.yaml").write_text("trainer: {no_such_key: 1}\n")  # an older version's: said, not refused
    check_same_run(tmp_path, load_config(None, ["name=x"], base=recipes.DEMO))
    assert "cannot compare with the run's config.yaml" in caplog.text


def test_run_training_refuses_the_resume_before_starting_anything(tmp_path: Path, tiny_model_path: Path) -> None:
    import asyncio

    from agentrl.launcher import recipes
    from agentrl.launcher.config import load_config, save_config
    from agentrl.launcher.driver import run_training

    overrides = ["name=x", f"runs_dir={tmp_path}", f"model={tiny_model_path}"]
    run_dir = tmp_path / "x"
    run_dir.mkdir()
    save_config(load_config(None, [*overrides, "trainer.lora.r=8"], base=recipes.SMOKE), run_dir / "config.yaml")
    with pytest.raises(ConfigError, match="trainer.lora was .* now null"):
        asyncio.run(run_training(load_config(None, overrides, base=recipes.SMOKE), resume=True))
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE, "config.yaml"]  # nothing started or written
    assert "lora" in (run_dir / "config.yaml").read_text()  # the run's own config kept
    lock, _ = claim_run_dir(run_dir, resume=True, overwrite=False)  # and the directory released
    lock.close()
