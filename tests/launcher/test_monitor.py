"""The run monitor: metrics.jsonl lines become Prometheus gauges (real HTTP endpoint) and TensorBoard events."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from agentrl.launcher.monitor import RunMonitor


def test_gauges_and_tensorboard_follow_the_trainer_metrics(tmp_path: Path):
    (tmp_path / "logs").mkdir()
    mon = RunMonitor(tmp_path, total_steps=3, live=False, prometheus_port=0, tensorboard=True)
    try:
        with open(tmp_path / "metrics.jsonl", "w") as f:
            f.write(json.dumps({"step": 1, "weight_version": 1, "reward_mean": 0.25, "staleness_mean": 0.5,
                                "staleness_max": 1, "loss": 0.1}) + "\n")
            f.write('{"step": 2, "weight_version": 2, "rew')  # a line being written: not read yet
        mon.update({"generated_tokens": 100, "queue_length": 7, "version": 1})
        mon.update({"generated_tokens": 300, "queue_length": 3, "queue_pending": 2, "version": 1})
        assert "queue 1 (+2 read, unacked)" in mon.line  # XLEN counts entries read and not yet acknowledged
        assert mon.values["step"] == 1 and mon.values["reward_mean"] == 0.25
        assert mon.values["rollout_tokens_per_s"] > 0 and mon.values["queue_length"] == 3
        body = urllib.request.urlopen(mon.metrics_url, timeout=5).read().decode()
        assert "agentrl_reward_mean 0.25" in body and "agentrl_queue_length 3.0" in body
        assert (tmp_path / "logs" / "metrics_url").read_text() == mon.metrics_url
        with open(tmp_path / "metrics.jsonl", "a") as f:
            f.write('ard_mean": 0.75, "staleness_mean": 0, "staleness_max": 0}\n')
        mon.update(None)
        assert mon.values["step"] == 2 and mon.values["reward_mean"] == 0.75
    finally:
        mon.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    got = {tag: [(e.step, round(float(tensor_util.make_ndarray(e.tensor_proto)), 6)) for e in events.Tensors(tag)]
           for tag in events.Tags()["tensors"]}
    assert got["train/reward_mean"] == [(1, 0.25), (2, 0.75)]
    assert got["train/loss"] == [(1, 0.1)] and "train/step" not in got


def test_the_monitor_writes_tensorboard_events_without_importing_torch(tmp_path: Path):
    """The controller runs the monitor: TensorBoard's own writer keeps torch out of it."""
    child = ("import sys; from pathlib import Path; from agentrl.launcher.monitor import RunMonitor; "
             "d = Path(sys.argv[1]); (d / 'logs').mkdir(); "
             "m = RunMonitor(d, 1, live=False, prometheus_port=None, tensorboard=True); "
             "(d / 'metrics.jsonl').write_text('{\"step\": 1, \"loss\": 0.5}\\n'); m.update(None); m.close(); "
             "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", child, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.split()[-1] == "False"
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_rollout_rate_counts_generated_tokens_of_filtered_groups_too(tmp_path: Path):
    (tmp_path / "logs").mkdir()
    mon = RunMonitor(tmp_path, total_steps=3, live=False, prometheus_port=None, tensorboard=False)
    try:
        mon.update({"model_tokens": 0, "generated_tokens": 0, "queue_length": 0, "version": 0})
        mon.update({"model_tokens": 0, "generated_tokens": 500, "queue_length": 0, "version": 0})  # all filtered
        assert mon.values["rollout_tokens_per_s"] > 0
    finally:
        mon.close()


def test_pass_rate_is_that_of_the_newest_version_over_all_groups(tmp_path: Path):
    (tmp_path / "logs").mkdir()
    mon = RunMonitor(tmp_path, total_steps=3, live=False, prometheus_port=0, tensorboard=False)
    try:
        solved = {0: [2, 8], 10: [12, 16], 9: [0, 8]}
        mon.update({"generated_tokens": 0, "queue_length": 0, "solved_by_version": solved})
        assert mon.values["rollout_pass_rate"] == 0.75  # version 10, not 9 (the order of the keys does not matter)
        body = urllib.request.urlopen(mon.metrics_url, timeout=5).read().decode()
        assert "agentrl_rollout_pass_rate 0.75" in body
    finally:
        mon.close()
