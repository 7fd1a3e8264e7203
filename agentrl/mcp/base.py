"""What both directions of the MCP bridge share: the two kinds of failure, and a tool result as observation text.

An MCP tool call can go wrong in two ways, kept apart as everywhere in agentrl (``agentrl.errors``):

- the **tool** failed on these arguments (the server answered a ``CallToolResult`` with ``isError``, or a
  JSON-RPC ``INVALID_PARAMS`` for an unknown tool or arguments it refused): the model's mistake, shown to the
  model as the tool's answer (:class:`McpToolError`, outside the error tree like ``ToolArgumentsError``);
- the **server** failed: it could not be started or reached, closed the connection, answered any other protocol
  error, or did not answer within the call's deadline (:class:`McpServerError`, an ``InfrastructureError``: the
  group is retried or dropped, never scored).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agentrl.errors import ConfigError, InfrastructureError

#: the JSON-RPC code of a call whose tool is unknown or whose arguments were refused (the caller's mistake)
INVALID_PARAMS = -32602
#: the JSON-RPC code our server answers when agentrl's own infrastructure (the sandbox) failed
INTERNAL_ERROR = -32603


class McpServerError(InfrastructureError):
    """An MCP server could not be started or reached, closed the connection, answered a protocol error, or did
    not answer a call within its deadline (the message names the server and the call)."""


class McpToolError(Exception):
    """An MCP tool reported an error for these arguments (``isError``): the model's mistake, never
    infrastructure; its message is what the tool said."""


def require_sdk() -> None:
    """Raise ConfigError, saying how to install it, when the ``mcp`` SDK is missing."""
    try:
        import mcp  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"agentrl.mcp needs the official MCP SDK ({exc}): pip install 'agentrl[mcp]'") from None


def content_text(content: Sequence[Any], structured: Any = None) -> str:
    """The text a model reads for a tool result's content blocks: text blocks verbatim, embedded text resources
    by their text, other blocks (images, audio, blobs, links) as a one-line placeholder; the structured result
    as JSON when there is no content. Blocks are joined by newlines."""
    parts = []
    for block in content:
        kind = getattr(block, "type", None)
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource":
            resource = block.resource
            text = getattr(resource, "text", None)
            parts.append(text if text is not None
                         else f"[resource {resource.uri} ({resource.mime_type or 'binary'})]")
        elif kind == "resource_link":
            parts.append(f"[resource link {block.uri}{f' ({block.name})' if block.name else ''}]")
        elif kind in ("image", "audio"):
            parts.append(f"[{kind} ({block.mime_type}, {len(block.data) * 3 // 4} bytes)]")
        else:
            parts.append(f"[{kind or type(block).__name__} content]")
    if not parts and structured is not None:
        return json.dumps(structured, ensure_ascii=False, default=str)
    return "\n".join(parts)
