"""SIGTERM takes the SIGINT path (agentrl/launcher/signals.py); the real run is in tests/test_smoke_e2e.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest


def _child(body: str) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent("""
        import os, signal, time
        from agentrl.launcher import signals
        """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_sigterm_raises_keyboard_interrupt_whether_or_not_sigint_is_ignored(sigint: str) -> None:
    out = _child(f"""
        if {sigint == "ignored"}:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job of a non-interactive shell
        signals.stop_on_sigterm()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            print("not stopped")
        except KeyboardInterrupt:
            print("stopped", signals.terminated())
        """)
    assert out.stdout.strip() == "stopped True", out.stdout + out.stderr


def test_sigterm_cancels_asyncio_run_like_ctrl_c_so_finally_blocks_run() -> None:
    out = _child("""
        import asyncio
        async def main():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                await asyncio.sleep(5)
            finally:
                print("cleaned up")
        signals.stop_on_sigterm()
        try:
            asyncio.run(main())
        except KeyboardInterrupt:
            print("stopped", signals.terminated())
        """)
    assert out.stdout.splitlines() == ["cleaned up", "stopped True"], out.stdout + out.stderr


def test_without_the_handler_sigterm_kills_at_once() -> None:
    """The control: Python's default, no clean-up (what the handler is for)."""
    out = _child("""
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        finally:
            print("cleaned up")
        """)
    assert out.returncode == -signal.SIGTERM and "cleaned up" not in out.stdout
