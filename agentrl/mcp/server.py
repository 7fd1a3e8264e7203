"""agentrl's tools served as an MCP server (the official ``mcp`` SDK's low-level ``Server``), so an agent that speaks
MCP (Claude Code, Codex, the OpenAI Agents SDK, …) can call them, and the sandboxed Python interpreter with them.

``build_server(tools, sandbox=…)`` answers ``tools/list`` with each tool's schema (the one ``@agentrl.tool`` made
from its signature) plus, given a sandbox, a ``python`` tool; ``tools/call``:

- checks the arguments with ``Tool.validate``; a refusal is a result with ``isError`` saying what was expected
  (the caller can correct itself, as the MCP spec asks of input errors);
- runs the tool under ``tool_timeout_s``; an exception it raises, or running past the limit, is an ``isError``
  result (the call's fault); an ``InfrastructureError`` it raises (a sandbox that is down) is a JSON-RPC
  ``INTERNAL_ERROR``, never a tool answer;
- an unknown tool is a JSON-RPC ``INVALID_PARAMS`` naming the tools there are.

The ``python`` tool runs code in the sandbox (agentrl's local bubblewrap or Docker backend, with its hard limits)
and answers stdout (and a trailing expression's value, as a notebook does), with stderr after it; a program that
fails or runs past ``python_limits.time_s`` is an ``isError`` result; a sandbox that cannot run it an
``INTERNAL_ERROR``. **State** (variables kept between calls):

- stdio (``one_client=True``): one interpreter for the server process, i.e. for its one client, in either era;
- streamable HTTP in the handshake protocol era (2025-11-25 and before: an ``Mcp-Session-Id`` session): one
  interpreter per MCP session, closed with it (``Connection.exit_stack``);
- streamable HTTP in the 2026-07-28 era: that protocol has no sessions (each request gets its own connection), so
  every call runs in a fresh interpreter (stateless). So does every call when the SDK does not hand the handler
  its connection (it does so only as the private ``ServerSession._connection`` in mcp 2.x).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from agentrl.env.hermes import render_tool_output, run_tool
from agentrl.env.tools import Tool, ToolArgumentsError
from agentrl.errors import ConfigError, InfrastructureError
from agentrl.mcp.base import INTERNAL_ERROR, INVALID_PARAMS, require_sdk
from agentrl.sandbox.base import Limits, RunRequest, RunResult, RunStatus, Sandbox

logger = logging.getLogger(__name__)

PYTHON_TOOL = "python"
PYTHON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"code": {"type": "string", "description": "Python source to run; print() what you want to see"}},
    "required": ["code"],
    "additionalProperties": False,
}
_STATE_KEY = "agentrl.mcp.python"


def build_server(tools: Sequence[Tool], *, sandbox: Sandbox | None = None, name: str = "agentrl",
                 tool_timeout_s: float = 30.0, python_limits: Limits | None = None,
                 max_output_chars: int = 8192, one_client: bool = False) -> Any:
    """An ``mcp.server.lowlevel.Server`` serving ``tools`` (and ``python`` when ``sandbox`` is given); see the
    module docstring. ``one_client=True`` (a stdio server: one client per process) keeps one interpreter for the
    whole process in every protocol era. The caller owns ``sandbox`` (start it before, close it after serving:
    that also closes the interpreters)."""
    require_sdk()
    python_limits = python_limits or Limits(time_s=10.0)
    import mcp_types as types
    from mcp import MCPError
    from mcp.server.lowlevel import Server

    by_name = {t.name: t for t in tools}
    if len(by_name) != len(tools):
        raise ConfigError(f"two tools share a name: {sorted(t.name for t in tools)}")
    if sandbox is not None and PYTHON_TOOL in by_name:
        raise ConfigError(f"a registered tool is named {PYTHON_TOOL!r}, the name of the sandbox's interpreter; "
                          "rename it (@agentrl.tool(name=...)) or serve without a sandbox")
    python = _PythonTool(sandbox, python_limits, max_output_chars, one_client) if sandbox is not None else None
    listed = [types.Tool(name=t.name, description=t.description, input_schema=t.parameters) for t in tools]
    if python is not None:
        listed.append(types.Tool(name=PYTHON_TOOL, input_schema=PYTHON_SCHEMA, description=(
            "Run Python code in a sandbox (no network; time and memory limited). Returns stdout and stderr. "
            "Variables persist between calls of one MCP session where the transport has sessions.")))

    def answer(text: str, *, error: bool = False) -> Any:
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=error)

    async def list_tools(ctx: Any, params: Any) -> Any:
        return types.ListToolsResult(tools=listed)

    async def call_tool(ctx: Any, params: Any) -> Any:
        arguments = params.arguments or {}
        try:
            if python is not None and params.name == PYTHON_TOOL:
                code = arguments.get("code") if isinstance(arguments, dict) else None
                if not isinstance(code, str) or set(arguments) != {"code"}:
                    return answer(f"invalid arguments for python(code): expected {{\"code\": string}}, got "
                                  f"{sorted(arguments) if isinstance(arguments, dict) else type(arguments).__name__}",
                                  error=True)
                text, failed = await python.run(code, ctx)
                return answer(text, error=failed)
            tool = by_name.get(params.name)
            if tool is None:
                available = sorted([*by_name, *([PYTHON_TOOL] if python else [])])
                raise MCPError(INVALID_PARAMS, f"unknown tool {params.name!r}; available: {', '.join(available)}")
            try:
                checked = tool.validate(arguments)
            except ToolArgumentsError as exc:
                return answer(str(exc), error=True)
            result = await run_tool(tool, checked, timeout_s=tool_timeout_s, max_chars=max_output_chars)
            return answer(result.output, error=result.status != "ok")
        except InfrastructureError as exc:
            logger.error("MCP tools/call %s: %s", params.name, exc)
            raise MCPError(INTERNAL_ERROR, f"{params.name}: agentrl's infrastructure failed: {exc}") from exc

    return Server(name, on_list_tools=list_tools, on_call_tool=call_tool,
                  get_tool_input_schema=lambda n: PYTHON_SCHEMA if python and n == PYTHON_TOOL else
                  (by_name[n].parameters if n in by_name else None))


class _PythonTool:
    """The sandbox's interpreter: one session per MCP connection that has one (or per process, for the one client
    of a stdio server), else one run per call."""

    def __init__(self, sandbox: Sandbox, limits: Limits, max_chars: int, one_client: bool) -> None:
        self.sandbox = sandbox
        self.limits = limits
        self.max_chars = max_chars
        # the interpreter of the process's one client (stdio), closed with the sandbox
        self.process_state: dict[str, Any] | None = {} if one_client else None

    async def run(self, code: str, ctx: Any) -> tuple[str, bool]:
        """(answer text, whether it is an error); raises ``SandboxError`` when the sandbox could not run it."""
        connection, note = _session_connection(ctx), ""
        state = connection.state if connection is not None else self.process_state
        if state is None:
            result = await self.sandbox.run(RunRequest(code=code, limits=self.limits))
        else:
            lock = state.setdefault(_STATE_KEY + ".lock", asyncio.Lock())
            async with lock:  # one cell at a time, in the order they came, in the session's interpreter
                session, note = state.get(_STATE_KEY), ""
                if session is not None and getattr(session, "closed", False):
                    # the sandbox closes an interpreter left idle (``session_idle_s``); the client's session lives on
                    note = "(the interpreter had been idle too long and was restarted: earlier variables are gone)\n"
                    session = None
                if session is None:
                    session = await self.sandbox.session("python", self.limits)
                    state[_STATE_KEY] = session
                    if connection is not None:
                        connection.exit_stack.push_async_callback(session.aclose)
                result = await session.run(code, time_s=self.limits.time_s)
        result.raise_for_sandbox()
        return note + self._render(result), result.run_status is not RunStatus.FINISHED or bool(result.exit_code)

    def _render(self, result: RunResult) -> str:
        parts = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
        parts += list(result.display)
        if result.stderr.strip():
            parts.append(result.stderr.rstrip("\n"))
        if result.run_status is RunStatus.TIME_LIMIT_EXCEEDED:
            parts.append(f"TimeoutError: the code ran past its time limit ({self.limits.time_s:g}s) and was stopped")
        text = "\n".join(parts) or "(no output; use print() to see values)"
        return render_tool_output(text, self.max_chars)


def _session_connection(ctx: Any) -> Any:
    """The SDK's ``Connection`` of this request when it outlives the request (a session), else None."""
    from mcp_types.version import MODERN_PROTOCOL_VERSIONS

    if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
        return None  # 2026-07-28: a fresh connection per request
    connection = getattr(ctx.session, "_connection", None)
    if connection is None or not hasattr(connection, "state") or not hasattr(connection, "exit_stack"):
        return None
    return connection


async def serve_stdio(server: Any) -> None:
    """Serve one client over this process's stdin/stdout until it closes them (log to stderr only)."""
    from mcp.server.stdio import stdio_server

    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


async def serve_http(server: Any, *, host: str = "127.0.0.1", port: int = 8765, path: str = "/mcp",
                     token: str | None = None) -> None:
    """Serve streamable HTTP at ``http://host:port/path`` until interrupted (uvicorn). With ``token``, every request
    needs ``Authorization: Bearer <token>`` (401 otherwise). On a loopback host the SDK's DNS-rebinding protection
    is on (only loopback ``Host``/``Origin`` headers are accepted)."""
    import uvicorn

    from agentrl._http import BearerGate

    app: Any = server.streamable_http_app(host=host, streamable_http_path=path)
    if token:
        app = BearerGate(app, token, hint=" (the --token / AGENTRL_MCP_TOKEN the server was started with)")
    await uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning")).serve()
