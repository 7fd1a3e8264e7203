"""benchmarks/sglang_memory.py's readings: a process group's members by role, with figures that add up."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from sglang_memory import group_pids, reading, role, status  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux /proc")


def test_a_group_is_read_by_role_and_its_figures_add_up() -> None:
    # a leader that allocates 200 MiB and holds it, and a child named like SGLang's scheduler
    code = ("import setproctitle, subprocess, sys, time; b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096]); "
            "subprocess.Popen([sys.executable, '-c', 'import setproctitle, time; "
            "setproctitle.setproctitle(\"sglang::scheduler\"); time.sleep(60)']); time.sleep(60)")
    leader = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(group_pids(leader.pid)) < 2 or "scheduler" not in {role(p, leader.pid) for p in
                                                                     group_pids(leader.pid)}:
            assert time.monotonic() < deadline, "the child never showed up with its title"
            time.sleep(0.1)
        while status(leader.pid).get("anon", 0) < 200 << 20:
            assert time.monotonic() < deadline, "the leader never touched its 200 MiB"
            time.sleep(0.1)
        figures = reading(leader.pid)
        assert set(figures) == {"launcher", "scheduler"}
        launcher = figures["launcher"]
        assert launcher["anon"] >= 200 << 20 and launcher["hwm"] >= launcher["rss"] >= launcher["anon"]
        assert 0 < launcher["pss"] <= launcher["rss"]
        assert figures["scheduler"]["rss"] < 100 << 20  # the child did not allocate
    finally:
        subprocess.run(["kill", "--", f"-{leader.pid}"], check=False)
        leader.wait(timeout=10)
    assert status(leader.pid) == {}  # gone: no figures
