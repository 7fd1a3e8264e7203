"""Fault recovery end to end (real SGLang, Redis, FSDP2, Ray): a trainer killed mid-run is restarted from its last
checkpoint and the run finishes with the books balanced (produced = consumed + dropped + left in the queue)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.sglang]


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_trainer_killed_mid_run_is_restarted_and_the_books_balance(tmp_path: Path):
    run = tmp_path / "faulty"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "demo", "--smoke", f"runs_dir={tmp_path}", "name=faulty",
         "sft.enabled=false", "steps=4", "rollout.max_staleness=1", "monitor.live=false"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 900
        while len(_lines(run / "metrics.jsonl")) < 1:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no trainer step within 15 minutes"
            time.sleep(0.5)
        pid = int((run / "logs" / "trainer-0.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=1200)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["trainer_restarts"] == 1
    assert summary["final_weight_version"] == 4 and summary["served_weight_version"] == 4
    assert summary["books_balanced"], summary
    metrics = _lines(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4], "each step recorded once, also the replayed one"
    assert int((run / "logs" / "trainer-0.pid").read_text()) != pid
