"""benchmarks/sandbox_bench.py's floors: the bare launcher (real launcher, no bubblewrap) cleans up after a run
as the sandbox does, and ``FreshLocal`` really starts a sandbox per run (real bubblewrap)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from sandbox_bench import BareLauncher, FreshLocal  # noqa: E402

from agentrl.sandbox.base import Limits, RequestStatus, RunRequest  # noqa: E402
from agentrl.sandbox.local import LocalSandbox  # noqa: E402

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="the floor needs root (setpriv, a PID namespace)"),
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")]
LIMITS = Limits(time_s=10)


async def run(sb: object, code: str) -> str:
    r = await sb.run(RunRequest(code=code, limits=LIMITS))  # type: ignore[attr-defined]
    assert r.status is RequestStatus.SUCCESS, r
    return r.stdout


async def test_floor_kills_what_the_program_left_and_empties_its_dir() -> None:
    marker = f"{os.getpid() % 1000}.{os.urandom(2).hex()[:3]}".replace("a", "1").replace("b", "2")
    leftover = f"import subprocess; subprocess.Popen(['sleep', '3{marker}'], start_new_session=True); print('ok')"
    async with BareLauncher(max_concurrency=1) as floor:
        assert await run(floor, "import os; print(os.getuid())") == "65534\n"
        assert await run(floor, leftover) == "ok\n"
        assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", f"3{marker}"]]
        await run(floor, "open('left.txt', 'w').write('x')")
        assert await run(floor, "import os; print(sorted(os.listdir('.')))") == "['main.py']\n"  # the same worker
        workdir = await run(floor, "import os; print(os.getcwd())")
    assert not os.path.exists(workdir.strip())


async def test_fresh_local_starts_a_sandbox_per_run_and_the_warm_pool_does_not() -> None:
    started = "print(open('/proc/1/stat').read().split()[21])"  # the namespace's init: when it started
    async with FreshLocal(max_concurrency=1) as fresh:
        assert await run(fresh, started) != await run(fresh, started)
    async with LocalSandbox(max_concurrency=1, pool_size=1) as warm:
        assert await run(warm, started) == await run(warm, started)
