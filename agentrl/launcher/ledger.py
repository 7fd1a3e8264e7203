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


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat`` field 22), None if there is no such
    process: with the pid, it names one process for the machine's uptime."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def record_process(run_dir: Path, name: str, pid: int) -> None:
    """Note a process group this run started (its leader's pid and start time)."""
    path = run_dir / LEDGER
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"name": name, "pid": pid, "start": _start_ticks(pid)}) + "\n")


def _recycled(entry: dict) -> bool:
    """The entry's pid now belongs to another process: its leader is gone and the pid was handed out again (a
    resumed run's ledger still names the first segment's servers). A group whose leader died but whose members
    live on keeps its id: Linux hands out no pid that is still a process group's id, so such a group is ours."""
    start = entry.get("start")
    now = _start_ticks(entry["pid"])
    return start is not None and now is not None and now != start


def kill_recorded(run_dir: Path) -> int:
    """SIGTERM, then SIGKILL, every process group in this node's ledger of ``run_dir``; returns how many groups
    were still there."""
    path = Path(run_dir) / LEDGER
    if not path.exists():
        return 0
    found = 0
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        pid = entry["pid"]
        if _recycled(entry):
            continue
        for n, sig in enumerate((signal.SIGTERM, signal.SIGKILL)):
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            found += n == 0
            time.sleep(0.5)
    return found
