"""The ReTool text format shared by the environment (``agentrl.env.retool``, at rollout time) and the SFT traces
(``agentrl.data``): an interpreter observation is exactly this text in both, so SFT and RL see the same tokens."""

from __future__ import annotations

INTERPRETER_OPEN, INTERPRETER_CLOSE = "<interpreter>", "</interpreter>"


def format_interpreter(output: str) -> str:
    """The observation text appended after a code turn (kept identical in SFT traces and rollouts)."""
    return f"\n{INTERPRETER_OPEN}\n{output.strip()}\n{INTERPRETER_CLOSE}\n"
