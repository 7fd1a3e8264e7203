"""The ledger of process groups a run started (``logs/processes.jsonl``: SGLang servers), so that they are killed
whatever happens to their owner.

The ledger is a file of the node that started the processes: the rollout actor writes it in its node's run
directory, and only code on that node can read it and signal the pids it names. On Ray the controller therefore
kills them with a task pinned to the rollout actor's node (:func:`agentrl.launcher.placement.place`); in debug
mode, and on one machine, that node is the controller's own.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

LEDGER = Path("logs") / "processes.jsonl"


def record_process(run_dir: Path, name: str, pid: int) -> None:
    """Note a process group this run started (its leader's pid)."""
    path = run_dir / LEDGER
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"name": name, "pid": pid}) + "\n")


def kill_recorded(run_dir: Path) -> int:
    """SIGTERM, then SIGKILL, every process group in this node's ledger of ``run_dir``; returns how many groups
    were still there."""
    path = Path(run_dir) / LEDGER
    if not path.exists():
        return 0
    found = 0
    for line in path.read_text().splitlines():
        pid = json.loads(line)["pid"]
        for n, sig in enumerate((signal.SIGTERM, signal.SIGKILL)):
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            found += n == 0
            time.sleep(0.5)
    return found
