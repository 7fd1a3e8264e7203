"""A small MCP server written with the official SDK (``MCPServer``, FastMCP's successor in mcp 2.x), for the tests
of agentrl's MCP client: ``python mcp_test_server.py stdio`` or ``python mcp_test_server.py http PORT``."""

from __future__ import annotations

import sys

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("agentrl-test-tools")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def shout(text: str, times: int = 1) -> str:
    """The text in capitals, repeated."""
    return " ".join([text.upper()] * times)


@server.tool()
def divide(a: float, b: float) -> float:
    """Divide a by b (b = 0 is the tool's error, reported with isError)."""
    if b == 0:
        raise ToolError("cannot divide by zero")
    return a / b


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep, then answer."""
    await anyio.sleep(seconds)
    return "woke up"


@server.tool()
def crash() -> str:
    """Kill this server process (a transport failure for the client)."""
    import os

    os._exit(3)


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
