"""The sandbox contract, run against every backend: local (bubblewrap), docker, remote (HTTP server), fleet (two)."""

from __future__ import annotations

import pytest

from agentrl.errors import ConfigError
from agentrl.sandbox.base import Limits, RequestStatus, RunRequest, RunStatus, Sandbox, Session


async def test_success_reports_stdout_and_times(sandbox: Sandbox) -> None:
    r = await sandbox.run(RunRequest(code="import sys\nprint('hello')\nprint('warn', file=sys.stderr)"))
    assert (r.status, r.run_status, r.exit_code) == (RequestStatus.SUCCESS, RunStatus.FINISHED, 0)
    assert r.stdout == "hello\n" and r.stderr == "warn\n"
    assert r.wall_s > 0


async def test_nonzero_exit_is_the_programs_failure(sandbox: Sandbox) -> None:
    r = await sandbox.run(RunRequest(code="import sys\nprint('partial')\nsys.exit(3)"))
    assert (r.status, r.run_status, r.exit_code) == (RequestStatus.FAILED, RunStatus.ERROR, 3)
    assert r.stdout == "partial\n"
    assert not r.is_sandbox_error


async def test_exception_gives_a_clean_traceback(sandbox: Sandbox) -> None:
    r = await sandbox.run(RunRequest(code="def f():\n    raise ValueError('boom')\nf()"))
    assert (r.status, r.exit_code) == (RequestStatus.FAILED, 1)
    assert r.stderr.startswith("Traceback (most recent call last):\n  File \"/tmp/main.py\", line 3")
    assert r.stderr.rstrip().endswith("ValueError: boom")


async def test_stdin_and_name_main(sandbox: Sandbox) -> None:
    code = "if __name__ == '__main__':\n    a, b = map(int, input().split())\n    print(a + b)"
    r = await sandbox.run(RunRequest(code=code, stdin="2 40\n"))
    assert r.stdout == "42\n", r


async def test_bash(sandbox: Sandbox) -> None:
    r = await sandbox.run(RunRequest(code="read x; echo \"got $x\"; echo oops >&2; exit 2", language="bash",
                                     stdin="7\n"))
    assert (r.run_status, r.exit_code, r.stdout, r.stderr) == (RunStatus.ERROR, 2, "got 7\n", "oops\n")


async def test_files_in_and_out(sandbox: Sandbox) -> None:
    code = "data = open('in/data.txt').read()\nwith open('out.txt', 'w') as f:\n    f.write(data.upper())\n" \
           "open('unclosed.txt', 'w').write('x')\nleft_open = open('left.txt', 'w')\nleft_open.write('kept')"
    r = await sandbox.run(RunRequest(code=code, files={"in/data.txt": b"abc"},
                                     fetch_files=("out.txt", "left.txt", "missing.txt")))
    assert r.status is RequestStatus.SUCCESS, r
    assert r.files == {"out.txt": b"ABC", "left.txt": b"kept"}


async def test_time_limit_keeps_partial_output(sandbox: Sandbox) -> None:
    r = await sandbox.run(RunRequest(code="print('started', flush=True)\nwhile True: pass",
                                     limits=Limits(time_s=1.0)))
    assert (r.status, r.run_status) == (RequestStatus.FAILED, RunStatus.TIME_LIMIT_EXCEEDED)
    assert r.stdout == "started\n"
    assert "time limit" in r.message


async def test_output_is_truncated_with_a_marker(sandbox: Sandbox) -> None:
    r = await sandbox.run(RunRequest(code="print('x' * 100000)", limits=Limits(output_bytes=1000)))
    assert r.status is RequestStatus.SUCCESS
    assert r.stdout.startswith("x" * 1000)
    assert "output truncated, 99001 more bytes" in r.stdout
    assert len(r.stdout) < 1100


async def test_each_run_starts_clean(sandbox: Sandbox) -> None:
    dirty = "import os, subprocess\nopen('/tmp/left.txt', 'w').write('x')\n" \
            "subprocess.Popen(['sleep', '60'], start_new_session=True)\nprint('dirty')"
    check = "import os\nprint(os.path.exists('/tmp/left.txt'), sorted(os.listdir('/tmp')))"
    assert (await sandbox.run(RunRequest(code=dirty))).stdout == "dirty\n"
    for _ in range(6):  # more runs than warm sandboxes: one of them lands where the dirty run was
        r = await sandbox.run(RunRequest(code=check))
        assert r.stdout == "False ['main.py']\n", r


async def test_unsupported_language_is_a_config_error(sandbox: Sandbox) -> None:
    with pytest.raises(ConfigError):
        await sandbox.run(RunRequest(code="puts 1", language="ruby"))


async def test_numpy_and_sympy_are_available(sandbox: Sandbox) -> None:
    code = "import numpy as np, sympy as sp\nx = sp.Symbol('x')\nprint(int(np.arange(5).sum()), sp.diff(x**3, x))"
    r = await sandbox.run(RunRequest(code=code, limits=Limits(time_s=20)))
    assert r.stdout == "10 3*x**2\n", r


# ---------------------------------------------------------------------------------------------------- sessions


async def test_session_keeps_state(sandbox: Sandbox) -> None:
    s: Session = await sandbox.session("python", Limits(time_s=5))
    try:
        assert (await s.run("x = 1")).status is RequestStatus.SUCCESS
        r = await s.run("x += 41\nprint(x)\nx * 2")
        assert (r.status, r.stdout, r.display) == (RequestStatus.SUCCESS, "42\n", ("84",))
        r = await s.run("import subprocess\nsubprocess.run(['echo', 'from a child'])")
        assert r.stdout == "from a child\n"
    finally:
        await s.aclose()


async def test_session_error_keeps_state(sandbox: Sandbox) -> None:
    s = await sandbox.session("python", Limits(time_s=5))
    try:
        await s.run("y = 5")
        r = await s.run("print('before')\nprint(undefined_name)")
        assert (r.status, r.run_status) == (RequestStatus.FAILED, RunStatus.ERROR)
        assert r.stdout == "before\n"
        assert r.stderr.rstrip().endswith("NameError: name 'undefined_name' is not defined")
        assert "<cell-" in r.stderr and "launcher" not in r.stderr
        assert (await s.run("print(y)")).stdout == "5\n"
    finally:
        await s.aclose()


async def test_session_cell_timeout_interrupts_the_cell_and_keeps_state(sandbox: Sandbox) -> None:
    s = await sandbox.session("python", Limits(time_s=5))
    try:
        await s.run("z = 3")
        r = await s.run("import time\nprint('tick', flush=True)\ntime.sleep(60)", time_s=1.0)
        assert (r.status, r.run_status) == (RequestStatus.FAILED, RunStatus.TIME_LIMIT_EXCEEDED)
        assert r.stdout == "tick\n" and r.wall_s < 5
        r = await s.run("print(z)")
        assert (r.status, r.stdout) == (RequestStatus.SUCCESS, "3\n")
    finally:
        await s.aclose()


async def test_session_cell_that_swallows_the_timeout_is_killed_and_restarted(sandbox: Sandbox) -> None:
    s = await sandbox.session("python", Limits(time_s=5))
    try:
        await s.run("z = 3")
        hostile = "import time\nwhile True:\n    try:\n        time.sleep(10)\n    except BaseException:\n        pass"
        r = await s.run(hostile, time_s=1.0)
        assert (r.status, r.run_status) == (RequestStatus.FAILED, RunStatus.TIME_LIMIT_EXCEEDED)
        r = await s.run("print('z' in globals())")
        assert (r.status, r.stdout) == (RequestStatus.SUCCESS, "False\n")
    finally:
        await s.aclose()


async def test_session_crash_is_the_programs_error(sandbox: Sandbox) -> None:
    s = await sandbox.session("python", Limits(time_s=5))
    try:
        r = await s.run("import os\nos._exit(7)")
        assert (r.status, r.run_status) == (RequestStatus.FAILED, RunStatus.ERROR), r
        assert not r.is_sandbox_error
        assert (await s.run("print('alive')")).stdout == "alive\n"
    finally:
        await s.aclose()


async def test_closed_session_reports_sandbox_error(sandbox: Sandbox) -> None:
    s = await sandbox.session("python")
    await s.aclose()
    r = await s.run("print(1)")
    assert r.is_sandbox_error and "closed" in r.message
