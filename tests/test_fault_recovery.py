"""Fault recovery end to end (real SGLang, Redis, FSDP2, Ray): a trainer killed mid-run is restarted from its last
checkpoint, an SGLang server killed mid-run is restarted and re-synced to the current weights, an external Redis
killed mid-run and restarted from its append-only file is ridden out, and a rollout process killed mid-run stops the
run with an error that says to resume, which then finishes it. Every time the books balance (produced = consumed +
dropped + left in the queue) and no step is trained twice."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.sglang, pytest.mark.redis]  # own Redis; the SGLang-kill test its own server


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _smoke_run(tmp_path: Path, *extra: str, server: str | None = None) -> tuple[Path, subprocess.Popen]:
    """``agentrl demo --smoke``, 4 steps; on the session's SGLang server (``engine.url``: no server start-up, ~40 s
    a run) when ``server`` is given, else on a server of its own (the test that kills it)."""
    if server is not None:
        extra = (f"engine.url={server}", "engine.dtype=float32", *extra)  # the session's server serves fp32
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "demo", "--smoke", f"runs_dir={tmp_path}", "name=faulty",
         "sft.enabled=false", "steps=4", "rollout.max_staleness=1", "monitor.live=false", *extra],
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


def test_trainer_killed_mid_run_is_restarted_and_the_books_balance(tmp_path: Path, shared_server: str):
    run, proc = _smoke_run(tmp_path, server=shared_server)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Redis7:
    """Debian's redis-server as an external service with its append-only file on (fsync every second, as deployed)."""

    def __init__(self, data: Path) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(binary).exists():
            pytest.skip("Debian's redis-server is not installed (scripts/install_system.sh test)")
        self.port, self.data = _free_port(), data
        self.cmd = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(data), "--save", "",
                    "--appendonly", "yes", "--appendfsync", "everysec", "--logfile", str(data / "redis.log")]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"redis-server did not start; see {self.data / 'redis.log'}")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)


def test_external_redis_killed_mid_run_and_restarted_from_its_aof_is_ridden_out(tmp_path: Path, shared_server: str):
    redis = _Redis7(tmp_path)
    redis.start()
    try:
        run, proc = _smoke_run(tmp_path, f"redis.url={redis.url}", server=shared_server)
        try:
            _wait_for_first_step(run, proc)
            redis.kill()  # SIGKILL: no shutdown save, only what the AOF holds
            time.sleep(3.0)
            redis.start()
        finally:
            _finish(proc)
        _assert_complete(run)  # 4 steps after a kill at step 1: the queue and registry lived through it
        assert "loaded from append only file" in (tmp_path / "redis.log").read_text().lower(), \
            "the restarted server replayed its AOF"
    finally:
        redis.kill()


def test_rollout_process_killed_mid_run_stops_with_a_clear_error_and_resume_finishes_it(tmp_path: Path,
                                                                                       shared_server: str):
    # on the shared server (engine.url): a rollout process killed between pausing it for a weight load and resuming
    # leaves it paused; the resumed run's pool clears that as it attaches (EnginePool._clear_stale_pause), and the
    # next tests find the server answering
    run, proc = _smoke_run(tmp_path, server=shared_server)
    try:
        _wait_for_first_step(run, proc)
        os.kill(int((run / "logs" / "rollout.pid").read_text()), signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]
    assert "the rollout process died" in out and "--resume" in out, out[-3000:]
    assert not (run / "summary.json").exists()
    steps_before = [m["step"] for m in _lines(run / "metrics.jsonl")]
    resumed, proc = _smoke_run(tmp_path, "--resume", server=shared_server)
    _finish(proc)
    summary = _assert_complete(run)
    assert summary["resumed_from_step"] is not None and steps_before[0] == 1
