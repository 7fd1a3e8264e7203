"""Helpers of the MCP tests: real server processes (the SDK's test server, ``agentrl mcp serve``) on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TEST_SERVER = str(HERE / "mcp_test_server.py")
SERVED_TOOLS = str(HERE / "served_tools.py")
sys.path.append(str(HERE.parent / "env"))  # tests/env's ScriptedEngine (env_support), for whole episodes


def agentrl_serve_args(*extra: str) -> list[str]:
    """``agentrl mcp serve`` (this worktree's code) with the test tools imported."""
    return ["-m", "agentrl.cli", "mcp", "serve", "--import", SERVED_TOOLS, "--tool-timeout", "1",
            "--python-timeout", "3", *extra]


def child_env() -> dict[str, str]:
    """What a spawned server needs beyond the SDK's minimal environment: this checkout on the path."""
    return {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def http_server(args: Sequence[str], port: int, timeout_s: float = 60.0) -> Iterator[str]:
    """``python args…`` serving streamable HTTP on 127.0.0.1:port; yields its MCP URL, stops it after."""
    proc = subprocess.Popen([sys.executable, *args], env={**os.environ, **child_env()}, cwd=REPO)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the MCP server exited with {proc.returncode} before listening")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the MCP server did not listen on port {port} within {timeout_s}s") from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
