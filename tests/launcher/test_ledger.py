"""The ledger of process groups a run started: every group it names is killed, the group's other members too."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from agentrl.launcher.ledger import _start_ticks, kill_recorded, record_process

#: a group leader that ignores SIGTERM, with a child in its group
STUBBORN = "import signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
           "subprocess.Popen(['sleep', '300']); print('ready', flush=True); time.sleep(300)"


def test_recorded_groups_are_killed_and_a_missing_ledger_is_nothing_to_do(tmp_path: Path) -> None:
    assert kill_recorded(tmp_path) == 0
    polite = subprocess.Popen(["sleep", "300"], start_new_session=True)
    stubborn = subprocess.Popen([sys.executable, "-c", STUBBORN], start_new_session=True, stdout=subprocess.PIPE,
                                text=True)
    try:
        assert stubborn.stdout is not None and stubborn.stdout.readline().strip() == "ready"
        record_process(tmp_path / "run", "polite", polite.pid)  # makes logs/ if this node has none yet
        record_process(tmp_path / "run", "stubborn", stubborn.pid)
        t0 = time.monotonic()
        assert kill_recorded(tmp_path / "run") == 2
        assert polite.wait(5) == -15 and stubborn.wait(5) == -9  # SIGKILL for the one that ignored SIGTERM
        assert time.monotonic() - t0 < 5
    finally:
        for p in (polite, stubborn):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_pid_handed_out_again_is_not_killed(tmp_path: Path) -> None:
    """A resumed run's ledger still names the first segment's servers: a group leader that got one of their pids
    later is someone else's, and is left alone; a group whose recorded leader is still that process is killed."""
    import json

    other = subprocess.Popen(["sleep", "300"], start_new_session=True)
    ours = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        record_process(tmp_path, "sglang", ours.pid)
        ledger = tmp_path / "logs" / "processes.jsonl"
        (entry,) = [json.loads(x) for x in ledger.read_text().splitlines()]
        assert entry["start"] is not None
        # the first segment's server had other's pid, and had started before it
        before = _start_ticks(other.pid)
        assert before is not None
        with open(ledger, "a") as f:
            f.write(json.dumps({"name": "sglang", "pid": other.pid, "start": before - 1}) + "\n")
        assert kill_recorded(tmp_path) == 1
        assert ours.wait(5) == -15
        time.sleep(0.2)
        assert other.poll() is None, "a process that only reused a recorded pid was signalled"
        with open(ledger, "a") as f:  # a ledger written before start times were recorded: pid alone, as before
            f.write(json.dumps({"name": "sglang", "pid": other.pid}) + "\n")
        assert kill_recorded(tmp_path) == 1 and other.wait(5) == -15
    finally:
        for p in (other, ours):
            if p.poll() is None:
                p.kill()
                p.wait()
