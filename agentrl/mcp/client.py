"""An MCP server's tools as agentrl tools: :class:`McpClient` connects (stdio subprocess or streamable HTTP, through
the official ``mcp`` SDK) and :meth:`McpClient.tools` lists them as :class:`McpTool`, a :class:`agentrl.env.Tool`
that any environment takes like its own (``ToolCallingEnv(resources, tools=await client.tools())``).

    async with McpClient.stdio("python", ["server.py"], call_timeout_s=10) as client:
        env = MyToolEnv(resources, tools=await client.tools())
        ...

A call is checked first against the tool's own JSON schema (what the server lists is what the model is told and
what is accepted); a refusal is a ``ToolArgumentsError`` the environment shows the model, and nothing is sent.
Then ``tools/call`` runs under ``call_timeout_s``. The result's content becomes the observation text
(:func:`agentrl.mcp.base.content_text`, capped at ``max_output_chars``); a result with ``isError`` raises
:class:`McpToolError` (the model's mistake: ``ToolCallingEnv`` shows it as an ``Error`` observation); a server
that cannot be reached, closes, answers a protocol error other than ``INVALID_PARAMS``, or does not answer within
the deadline raises :class:`McpServerError`, an ``InfrastructureError`` that ``ToolCallingEnv`` lets through, so the
group is retried and never scored. A slow tool is the server's to bound (it should answer ``isError`` past its
own limit); past ``call_timeout_s`` the call is abandoned as infrastructure. Give the environment a
``tool_timeout_s`` above ``call_timeout_s`` (the defaults: 30 s and 20 s), or its own timeout turns an unanswered
call into an observation first.

The SDK's client holds anyio task groups, which must be left by the task that entered them; so one task owned by
the client holds the connection from :meth:`start` to :meth:`aclose`, and calls may come from any task (episodes
run concurrently on one client).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from agentrl.env.hermes import render_tool_output
from agentrl.env.tools import Tool, ToolArgumentsError, _shown
from agentrl.errors import ConfigError
from agentrl.mcp.base import INVALID_PARAMS, McpServerError, McpToolError, content_text, require_sdk

logger = logging.getLogger(__name__)

#: how long closing may take: the SDK's stdio shutdown closes stdin, waits ~2 s, then kills the process tree
CLOSE_TIMEOUT_S = 10.0


class _SchemaChecked(BaseModel):
    """Placeholder for :attr:`Tool.arguments_model`: an MCP tool's arguments are checked by its JSON schema."""

    model_config = ConfigDict(extra="allow")


@dataclass(frozen=True, slots=True)
class McpTool(Tool):
    """A tool of an MCP server: ``parameters`` is the schema the server lists and :meth:`validate` checks
    arguments with it (JSON Schema, the dialect the schema names, 2020-12 by default)."""

    server: str = ""
    validator: Any = field(default=None, repr=False, compare=False)

    def validate(self, arguments: Any) -> dict[str, Any]:
        if not isinstance(arguments, dict):
            raise ToolArgumentsError(f"the arguments of {self.name} must be a JSON object "
                                     f"({self._signature()}), got {_shown(arguments)}")
        errors = sorted(self.validator.iter_errors(arguments), key=lambda e: [str(p) for p in e.absolute_path])
        if errors:
            raise ToolArgumentsError(f"invalid arguments for {self._signature()}: "
                                     + "; ".join(_explain(e) for e in errors))
        return dict(arguments)


def _explain(error: Any) -> str:
    """One jsonschema error as the model wrote it: ``argument 'b' is missing``, ``argument 'a': 'x' is not of
    type 'integer'``."""
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
    if error.validator == "required":
        missing = str(error.message).split("'")[1] if "'" in str(error.message) else str(error.message)
        return f"argument {repr(f'{path}.{missing}' if path else missing)} is missing"
    if error.validator == "additionalProperties":
        return f"unknown argument{'s in ' + repr(path) if path else ''}: {error.message}"
    return f"argument {path!r}: {error.message}" if path else str(error.message)


def _validator(server: str, name: str, schema: Mapping[str, Any]) -> Any:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    cls = validator_for(schema, default=Draft202012Validator)
    try:
        cls.check_schema(schema)
    except SchemaError as exc:
        raise ConfigError(f"MCP server {server} lists tool {name!r} with an invalid input schema: {exc.message}")
    return cls(schema)


class McpClient:
    """One connection to one MCP server, and its tools as :class:`McpTool` (see the module docstring).

    ``target`` is an ``mcp.StdioServerParameters`` (a command to spawn) or the URL of a streamable-HTTP endpoint;
    :meth:`stdio` and :meth:`http` build one. ``prefix`` is put before every tool name (two servers with a
    ``search`` tool: ``prefix="web_"``). Every network step has a deadline: connecting ``connect_timeout_s``,
    listing and calling ``call_timeout_s``."""

    def __init__(self, target: Any, *, name: str | None = None, prefix: str = "", call_timeout_s: float = 20.0,
                 connect_timeout_s: float = 30.0, max_output_chars: int = 8192,
                 headers: Mapping[str, str] | None = None) -> None:
        require_sdk()
        if call_timeout_s <= 0 or connect_timeout_s <= 0:
            raise ConfigError(f"MCP timeouts must be positive, got call_timeout_s={call_timeout_s}, "
                              f"connect_timeout_s={connect_timeout_s}")
        self.target = target
        self.name = name or (target if isinstance(target, str) else " ".join([target.command, *target.args]))
        self.prefix = prefix
        self.call_timeout_s = call_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_output_chars = max_output_chars
        self.headers = dict(headers or {})
        self._client: Any = None
        self._ready: asyncio.Future[None] | None = None
        self._owner: asyncio.Task[None] | None = None
        self._scope: Any = None  # the owner task's anyio.CancelScope
        self._closing = asyncio.Event()
        self._closed = False
        self._tools: list[McpTool] | None = None

    @classmethod
    def stdio(cls, command: str, args: Sequence[str] = (), *, env: Mapping[str, str] | None = None,
              cwd: str | None = None, **options: Any) -> McpClient:
        """A server spawned as ``command args…``, spoken to over its stdin/stdout. The child gets the SDK's
        minimal environment (PATH, HOME, …) plus ``env``."""
        from mcp import StdioServerParameters

        return cls(StdioServerParameters(command=command, args=list(args), env=dict(env) if env else None, cwd=cwd),
                   **options)

    @classmethod
    def http(cls, url: str, *, headers: Mapping[str, str] | None = None, **options: Any) -> McpClient:
        """A server at a streamable-HTTP endpoint (``http://host:port/mcp``), with extra request ``headers``
        (an ``Authorization`` bearer token, say)."""
        return cls(url, headers=headers, **options)

    async def start(self) -> McpClient:
        """Connect (spawn the server, or open the HTTP session) and negotiate; idempotent, and concurrent callers
        share one connection. Raises :class:`McpServerError` when the server cannot be started or does not answer
        within ``connect_timeout_s``."""
        if self._closed:
            raise McpServerError(f"MCP server {self.name}: the client is closed")
        if self._ready is None:
            loop = asyncio.get_running_loop()
            self._ready = loop.create_future()
            self._owner = loop.create_task(self._hold(self._ready), name=f"mcp {self.name}")
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await asyncio.shield(self._ready)
        except TimeoutError:
            await self.aclose()
            raise McpServerError(f"MCP server {self.name} did not answer within {self.connect_timeout_s:g}s "
                                 "of starting") from None
        except asyncio.CancelledError:
            if self._ready.cancelled():  # the connection was abandoned by aclose(), not this caller
                raise McpServerError(f"MCP server {self.name}: the client was closed while connecting") from None
            raise
        except Exception as exc:
            await self.aclose()
            raise McpServerError(f"MCP server {self.name} could not be started or reached: {_reason(exc)}") from exc
        if self._client is None:
            raise McpServerError(f"MCP server {self.name}: the connection ended (see the log for why)")
        return self

    async def _hold(self, ready: asyncio.Future[None]) -> None:
        """The owner task: enters the SDK's client, publishes it, waits for :meth:`aclose`, leaves it. Its anyio
        cancel scope lets :meth:`aclose` abandon a connection still being made while the SDK's shielded shutdown
        (close stdin, wait, kill the server's process tree) still runs; a plain task cancel would skip it."""
        import anyio
        from mcp import Client

        try:
            with anyio.CancelScope() as self._scope:
                async with contextlib.AsyncExitStack() as stack:
                    target = self.target
                    if isinstance(target, str) and self.headers:
                        import httpx2
                        from mcp.client.streamable_http import streamable_http_client

                        # the SDK's own client's timeouts (its default when no client is given), our connect
                        # deadline for connect/write/pool; a response stream may stay open (read 300 s)
                        timeout = httpx2.Timeout(self.connect_timeout_s, read=300.0)
                        http = await stack.enter_async_context(httpx2.AsyncClient(headers=self.headers,
                                                                                  timeout=timeout))
                        target = streamable_http_client(target, http_client=http)
                    client = Client(target, read_timeout_seconds=self.call_timeout_s)
                    self._client = await stack.enter_async_context(client)
                    ready.set_result(None)
                    await self._closing.wait()
        except Exception as exc:  # noqa: BLE001  (reported to start(), or logged: this task has no caller)
            if not ready.done():
                ready.set_exception(exc)
            else:
                logger.warning("MCP server %s: the connection ended: %s", self.name, _reason(exc))
        finally:
            self._client = None
            if not ready.done():
                ready.cancel()

    async def tools(self) -> list[McpTool]:
        """The server's tools (every page of ``tools/list``), as agentrl tools; listed once per connection."""
        if self._tools is None:
            client = await self._connected()
            listed, cursor = [], None
            for _ in range(100):  # a server whose pages never end cannot hang the listing
                page = await self._guarded("tools/list", client.list_tools(cursor=cursor))
                listed.extend(page.tools)
                cursor = page.next_cursor
                if cursor is None:
                    break
            self._tools = [self._as_tool(t) for t in listed]
        return list(self._tools)

    def _as_tool(self, listed: Any) -> McpTool:
        remote = listed.name

        async def call(**arguments: Any) -> str:
            return await self.call(remote, arguments)

        call.__name__ = call.__qualname__ = f"mcp:{self.name}:{remote}"  # how the registry names its origin
        return McpTool(name=self.prefix + remote, description=listed.description or listed.title or remote,
                       parameters=dict(listed.input_schema), fn=call, is_async=True, arguments_model=_SchemaChecked,
                       server=self.name, validator=_validator(self.name, remote, listed.input_schema))

    async def call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """Call tool ``name`` (the server's name, without ``prefix``); the result's content as observation text.
        Raises :class:`McpToolError` for ``isError`` results and refused calls, :class:`McpServerError` for the
        server's failures (see the module docstring)."""
        client = await self._connected()
        result = await self._guarded(f"tools/call {name}", client.call_tool(
            name, dict(arguments), read_timeout_seconds=self.call_timeout_s))
        text = render_tool_output(content_text(result.content, result.structured_content), self.max_output_chars)
        if result.is_error:
            raise McpToolError(text)
        return text

    async def _connected(self) -> Any:
        if self._client is None:
            await self.start()
        return self._client

    async def _guarded(self, what: str, request: Any) -> Any:
        """``request`` under the call deadline, the SDK's errors sorted into the two kinds (module docstring):
        only ``INVALID_PARAMS`` is the caller's; anything else (another JSON-RPC error, a closed connection, a
        result that does not validate) is the server's. The SDK's own read timeout answers first; ours (a second
        later) also bounds a transport stuck in a write."""
        from mcp import MCPError

        try:
            async with asyncio.timeout(self.call_timeout_s + 1.0):
                return await request
        except MCPError as exc:
            if exc.code == INVALID_PARAMS:
                raise McpToolError(exc.message) from None
            raise McpServerError(f"MCP server {self.name}: {what} failed: {exc.message} (code {exc.code})") from exc
        except TimeoutError:
            raise McpServerError(f"MCP server {self.name}: {what} got no answer within "
                                 f"{self.call_timeout_s:g}s") from None
        except Exception as exc:  # noqa: BLE001  (a broken transport, an answer that is not MCP: the server's fault)
            raise McpServerError(f"MCP server {self.name}: {what} failed: {_reason(exc)}") from exc

    async def aclose(self) -> None:
        """Close the connection (the stdio server is stopped, the HTTP session deleted); idempotent."""
        self._closed = True
        self._closing.set()
        owner, self._owner = self._owner, None
        if owner is None:
            return
        if self._ready is not None and not self._ready.done():  # still connecting: abandon it
            if self._scope is not None:
                self._scope.cancel()
            else:
                owner.cancel()  # not even started: nothing entered, nothing to shut down
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await asyncio.shield(owner)
        except TimeoutError:
            logger.warning("MCP server %s: the connection did not close within %gs; cancelled", self.name,
                           CLOSE_TIMEOUT_S)
            owner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await owner
        except asyncio.CancelledError:
            if not owner.cancelled():
                raise

    async def __aenter__(self) -> McpClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _reason(exc: BaseException) -> str:
    """An exception as one line; an ``ExceptionGroup`` (anyio task groups) by its innermost leaves."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_reason(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
