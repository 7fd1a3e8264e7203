"""MCP, both ways (the official ``mcp`` SDK, ``pip install 'agentrl[mcp]'``):

- in: :class:`McpClient` turns an MCP server's tools (stdio or streamable HTTP) into agentrl tools for any
  environment (:mod:`agentrl.mcp.client`);
- out: :func:`build_server` serves agentrl's registered tools, plus the sandbox's Python interpreter, as an MCP
  server; ``agentrl mcp serve`` runs it (:mod:`agentrl.mcp.server`).

Errors: :class:`McpToolError` (a tool's answer with ``isError``: the model's mistake) and :class:`McpServerError`
(an ``InfrastructureError``: the server failed), see :mod:`agentrl.mcp.base`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentrl._lazy import lazy_exports

if TYPE_CHECKING:
    from agentrl.mcp.base import McpServerError, McpToolError, content_text
    from agentrl.mcp.client import McpClient, McpTool
    from agentrl.mcp.server import build_server, serve_http, serve_stdio

_HOME = {
    **dict.fromkeys(["McpServerError", "McpToolError", "content_text"], "base"),
    **dict.fromkeys(["McpClient", "McpTool"], "client"),
    **dict.fromkeys(["build_server", "serve_http", "serve_stdio"], "server"),
}
__all__ = ["McpClient", "McpServerError", "McpTool", "McpToolError", "build_server", "content_text", "serve_http",
           "serve_stdio"]
__getattr__, __dir__ = lazy_exports(__name__, _HOME)
