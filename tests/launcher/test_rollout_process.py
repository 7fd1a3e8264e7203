"""The rollout process hands each component its own part of the run's `rollout:` section, as is."""

from __future__ import annotations

from pathlib import Path

from agentrl.launcher.config import load_config
from agentrl.launcher.rollout_process import RolloutWorker


def test_episodes_get_the_runs_sampling_and_budget(tmp_path: Path) -> None:
    cfg = load_config(None, ["rollout.top_k=20", "rollout.max_resumes=2", "rollout.temperature=0.8"])
    worker = RolloutWorker(cfg, tmp_path, "redis://unused")
    worker.engine, worker.tok = object(), object()  # what start() would set; the runner only keeps them
    runner = worker._runner()
    assert runner.sampling is cfg.rollout.sampling and runner.budget is cfg.rollout.budget
