"""pin_to_cores pins every thread of the process, not only the caller (Ray runs actor methods on other threads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

from agentrl.launcher.cores import pin_to_cores


def test_every_thread_and_later_children_are_pinned() -> None:
    before = os.sched_getaffinity(0)
    started, done = threading.Event(), threading.Event()
    seen: dict[str, set[int]] = {}

    def other_thread() -> None:
        started.set()
        done.wait(10)
        seen["other"] = os.sched_getaffinity(0)  # this thread's own mask
        child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, timeout=60, check=True)
        seen["child"] = set(json.loads(child.stdout))

    t = threading.Thread(target=other_thread)
    t.start()
    started.wait(10)
    try:
        pin_to_cores([0])  # called on this thread; the other one already runs
        done.set()
        t.join(60)
        assert seen == {"other": {0}, "child": {0}}
    finally:
        pin_to_cores(sorted(before))
