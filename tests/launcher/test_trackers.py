"""W&B (offline) and trackio (local database) fed by the run monitor from metrics.jsonl: the real clients."""

from __future__ import annotations

import importlib.util
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.errors import ConfigError
from agentrl.launcher.monitor import RunMonitor
from agentrl.launcher.trackers import WandbSection, check_trackers

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("wandb", "trackio")),
    reason="the [wandb] extra (wandb, trackio) is part of the test venv: scripts/install_venv.sh")


FEED = """
import json, sys
from pathlib import Path
from agentrl.launcher.monitor import RunMonitor
from agentrl.launcher.trackers import TrackioSection, WandbSection, make_trackers
run_dir = Path(sys.argv[1])
(run_dir / "logs").mkdir(parents=True)
trackers = make_trackers(WandbSection(project="agentrl-test"), TrackioSection(project="agentrl-test"),
                         name="t1", run_dir=run_dir, config={"steps": 3, "model": "tiny"})
monitor = RunMonitor(run_dir, 3, live=False, prometheus_port=None, tensorboard=False, trackers=trackers)
with open(run_dir / "metrics.jsonl", "w") as f:
    for step in (1, 2, 3):
        f.write(json.dumps({"step": step, "weight_version": step, "reward_mean": step / 8, "skipped": False}) + "\\n")
monitor.update(None)
monitor.finish({"reward_last": 0.375, "books_balanced": True, "run": "t1"})
monitor.close()
"""


def test_monitor_feeds_wandb_offline_and_trackio(tmp_path: Path) -> None:
    """In a child process: trackio reads TRACKIO_DIR when it is first imported."""
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "WANDB_SILENT": "true"}
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", FEED, str(run_dir)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (offline,) = (run_dir / "wandb").glob("offline-run-*-t1")
    (log,) = offline.glob("run-t1.wandb")
    data = log.read_bytes()  # W&B's own record format: the keys and values are in it
    assert data.count(b"train/reward_mean") >= 3 and b"0.375" in data and b"reward_last" in data
    db = sqlite3.connect(tmp_path / "trackio" / "agentrl-test.db")
    rows = db.execute("select step, metrics from metrics where run_name = 't1' order by step").fetchall()
    logged = {step: json.loads(m) for step, m in rows}
    assert [logged[s]["train/reward_mean"] for s in (1, 2, 3)] == [0.125, 0.25, 0.375]
    assert logged[1]["train/weight_version"] == 1 and "train/skipped" not in logged[1]
    assert any(m.get("summary/reward_last") == 0.375 for m in logged.values())


def test_a_failing_tracker_does_not_stop_the_monitor(tmp_path: Path) -> None:
    class Broken:
        calls = 0

        def log(self, metrics: object, step: int) -> None:
            Broken.calls += 1
            raise ConnectionError("tracker server down")

        def summary(self, values: object) -> None:
            raise ConnectionError("still down")

        def close(self) -> None:
            pass

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": 1.0}) + "\n"
                                                    for s in (1, 2)))
    monitor = RunMonitor(tmp_path, 2, live=False, prometheus_port=None, tensorboard=False, trackers=[Broken()])
    monitor.update(None)
    monitor.finish({})
    assert Broken.calls == 2 and monitor.values["step"] == 2.0


def test_a_missing_tracker_package_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_wandb(name: str, *args: object, **kwargs: object) -> object:
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    monkeypatch.delitem(__import__("sys").modules, "wandb", raising=False)
    with pytest.raises(ConfigError, match=r"monitor.wandb is set but wandb is not installed: pip install 'agentrl\[wandb\]'"):
        check_trackers(WandbSection(), None)
    check_trackers(None, None)
