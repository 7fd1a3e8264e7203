"""Fault recovery end to end (real SGLang, Redis, FSDP2, Ray): a trainer killed mid-run is restarted from its last
checkpoint, an SGLang server killed mid-run is restarted and re-synced to the current weights, and either way the
run finishes with the books balanced (produced = consumed + dropped + left in the queue)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.sglang, pytest.mark.redis]  # the run starts its own of each


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _smoke_run(tmp_path: Path) -> tuple[Path, subprocess.Popen]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "demo", "--smoke", f"runs_dir={tmp_path}", "name=faulty",
         "sft.enabled=false", "steps=4", "rollout.max_staleness=1", "monitor.live=false"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return tmp_path / "faulty", proc


def _wait_for_first_step(run: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 900
    while len(_lines(run / "metrics.jsonl")) < 1:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no trainer step within 15 minutes"
        time.sleep(0.5)


def _finish(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=1200)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    return out


def _assert_complete(run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_weight_version"] == 4 and summary["served_weight_version"] == 4
    assert summary["books_balanced"], summary
    metrics = _lines(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4], "each step recorded once, also a replayed one"
    return summary


def test_trainer_killed_mid_run_is_restarted_and_the_books_balance(tmp_path: Path):
    run, proc = _smoke_run(tmp_path)
    try:
        _wait_for_first_step(run, proc)
        pid = int((run / "logs" / "trainer-0.pid").read_text())
        os.kill(pid, signal.SIGKILL)
    finally:
        _finish(proc)
    summary = _assert_complete(run)
    assert summary["trainer_restarts"] == 1
    assert int((run / "logs" / "trainer-0.pid").read_text()) != pid


def test_sglang_server_killed_mid_run_is_restarted_and_the_books_balance(tmp_path: Path):
    run, proc = _smoke_run(tmp_path)
    try:
        _wait_for_first_step(run, proc)
        (first,) = [p for p in _lines(run / "logs" / "processes.jsonl") if p["name"] == "sglang"]
        os.killpg(first["pid"], signal.SIGKILL)  # the server and its scheduler/detokenizer children
    finally:
        _finish(proc)
    summary = _assert_complete(run)
    assert summary["engine_restarts"] >= 1 and summary["trainer_restarts"] == 0
    servers = [p["pid"] for p in _lines(run / "logs" / "processes.jsonl") if p["name"] == "sglang"]
    assert len(servers) >= 2 and servers[0] == first["pid"], "the restarted server is in the run's ledger"
