"""Helpers shared by the queue tests and their worker processes (a uniquely named module: every test folder
has its own conftest.py, so ``from conftest import ...`` would be ambiguous)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from agentrl.types import FinishReason, Trajectory, Turn

WORKER = Path(__file__).with_name("_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_trajectory(version: int = 0, n_tokens: int = 64, prompt_len: int = 16, tag: str = "") -> Trajectory:
    n_model = n_tokens - prompt_len
    return Trajectory(
        trajectory_id=Trajectory.new_id(), prompt_id=f"p{tag}", group_id="g",
        token_ids=[(7 * i + version) % 1000 for i in range(n_tokens)], prompt_len=prompt_len,
        loss_mask=[0] * prompt_len + [1] * n_model,
        behavior_logprobs=[0.0] * prompt_len + [-0.25] * n_model,
        weight_versions=[-1] * prompt_len + [version] * n_model,
        reward=1.0, finish_reason=FinishReason.STOP, reward_breakdown={"correct": 1.0},
        turns=(Turn(index=0, text="hi", token_start=prompt_len, token_end=n_tokens),), env="test",
        metadata={"tag": tag},
    )


def run_worker(*args: str) -> subprocess.Popen[str]:
    """Start tests/queue/_worker.py in its own Python process; it prints one line per event on stdout."""
    return subprocess.Popen([sys.executable, str(WORKER), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
