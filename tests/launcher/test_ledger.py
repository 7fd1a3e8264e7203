"""The ledger of process groups a run started: every group it names is killed, the group's other members too."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from agentrl.launcher.ledger import kill_recorded, record_process

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
