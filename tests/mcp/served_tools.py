"""Tools registered for ``agentrl mcp serve --import tests/mcp/served_tools.py`` in the tests."""

from __future__ import annotations

import asyncio

from agentrl.env import register_tool, tool
from agentrl.errors import SandboxError


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


@tool
def divide(a: float, b: float) -> float:
    """Divide a by b."""
    return a / b


@tool
async def nap(seconds: float) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return "rested"


@tool
async def broken_backend() -> str:
    """A tool whose backend is down (agentrl's infrastructure, not the caller's mistake)."""
    raise SandboxError("the sandbox at http://10.0.0.1 did not answer")


for t in (add, divide, nap, broken_backend):
    register_tool(t)
