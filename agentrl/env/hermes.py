"""Tool calling: calls in the model's turn (by default Hermes / Qwen's
``<tool_call>{"name": …, "arguments": {…}}</tool_call>``; other model families through SGLang's parsers, chosen
by the ``tool_parser`` option, see :mod:`agentrl.env.tool_parsers`), results in the chat template's ``tool`` role.

The model's turn ends with EOS as usual (one turn may hold several calls, run concurrently); the runner then
appends the tool messages as the chat template's delta (``ChatTokenizer.encode_messages_delta``: e.g.
``<|im_start|>tool\\n…<|im_end|>\\n<|im_start|>assistant\\n`` for ChatML; Qwen's template wraps them in
``<tool_response>``), loss mask 0, and the model answers or calls again. A turn without a call ends the episode.
The tool schemas reach the prompt through the template's ``tools`` (or, for templates without tool support,
a Hermes block in the system message).

Calls are dispatched to :class:`agentrl.env.tools.Tool` functions (``@agentrl.tool``): ``Tool.validate`` checks
the arguments, then ``await tool(**arguments)`` runs it under ``tool_timeout_s``. The model's mistakes become
error observations, never exceptions: bad JSON, a missing ``name``, an unknown tool, bad arguments, a tool that
raises or times out. A tool raising :class:`agentrl.errors.InfrastructureError` (a sandbox that is down) is not
the model's fault: it propagates and the group is retried. More calls than ``max_tool_calls`` end the episode.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from agentrl.env.base import Environment, Observation, StepResult, prompt_messages
from agentrl.env.registry import EnvResources
from agentrl.env.tool_parsers import BUILTIN, ParsedCall, make_tool_parser
from agentrl.env.tool_parsers import parse_tool_calls as parse_tool_calls  # re-exported: its home until now
from agentrl.env.tools import Tool
from agentrl.errors import ConfigError, InfrastructureError
from agentrl.types import Task, ToolCall, ToolResult


def render_tool_output(value: Any, max_chars: int) -> str:
    """A tool's return value as the text of its tool message (JSON for non-strings), capped."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    if len(text) > max_chars:
        text = text[:max_chars] + f"\n…[truncated {len(text) - max_chars} characters]"
    return text


class ToolCallingEnv(Environment):
    """Base class of environments with Hermes/Qwen tool calls. Subclasses set ``name``, usually ``tools`` (or
    pass ``tools=`` to the constructor: :class:`Tool` objects or names of registered tools), and implement
    :meth:`score`; :meth:`prompt` builds the messages (system prompt + the task's prompt by default)."""

    tools: ClassVar[tuple[Tool, ...]] = ()
    system_prompt: ClassVar[str | None] = None

    def __init__(self, resources: EnvResources, *, tools: Sequence[Tool | str] = (), max_tool_calls: int = 8,
                 tool_timeout_s: float = 30.0, max_output_chars: int = 2048, tool_parser: str = BUILTIN) -> None:
        self.resources = resources
        self.max_tool_calls = max_tool_calls
        self.tool_timeout_s = tool_timeout_s
        self.max_output_chars = max_output_chars
        self._tools = {t.name: t for t in (*self.tools, *(_resolve_tool(t) for t in tools))}
        if not self._tools:
            raise ConfigError(f"{type(self).__name__} has no tools: set the class attribute `tools` or pass tools=")
        self.parser = make_tool_parser(tool_parser, list(self._tools.values()))
        self.task: Task | None = None
        self.calls = 0

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self._tools.values()]

    def prompt(self, task: Task) -> list[dict[str, Any]]:
        return prompt_messages(task, self.system_prompt)

    async def reset(self, task: Task) -> list[dict[str, Any]]:
        self.task, self.calls = task, 0
        return self.prompt(task)

    async def step(self, text: str) -> StepResult:
        parsed = self.parser.parse(text)
        if not parsed:
            return StepResult(None, True)
        outcomes = await asyncio.gather(*(self._dispatch(p) for p in parsed))
        calls = tuple(c for c, _ in outcomes)
        results = tuple(r for _, r in outcomes)
        if any(r.status == "budget" for r in results):
            return StepResult(None, True, calls, results)
        messages = tuple({"role": "tool", "name": c.name or "unknown", "content": r.output}
                         for c, r in zip(calls, results))
        return StepResult(Observation(messages=messages), False, calls, results)

    async def _dispatch(self, p: ParsedCall) -> tuple[ToolCall, ToolResult]:
        call = ToolCall(name=p.name, arguments=p.arguments, raw=p.raw, error=p.error)
        if p.error is not None:
            return call, ToolResult(p.name, "malformed", f"Error: {p.error}")
        tool = self._tools.get(p.name)
        if tool is None:
            msg = f"unknown tool {p.name!r}; available: {', '.join(sorted(self._tools))}"
            return ToolCall(p.name, p.arguments, p.raw, error=msg), ToolResult(p.name, "unknown_tool", f"Error: {msg}")
        self.calls += 1  # counted before the first await: calls of one turn are numbered in order
        if self.calls > self.max_tool_calls:
            return call, ToolResult(p.name, "budget", f"tool-call budget of {self.max_tool_calls} exhausted")
        try:
            arguments = tool.validate(p.arguments)
        except ValueError as exc:
            return (ToolCall(p.name, p.arguments, p.raw, error=str(exc)),
                    ToolResult(p.name, "malformed", f"Error: {exc}"))
        return call, await self._run(tool, arguments)

    async def _run(self, tool: Tool, arguments: Mapping[str, Any]) -> ToolResult:
        return await run_tool(tool, arguments, timeout_s=self.tool_timeout_s, max_chars=self.max_output_chars)


async def run_tool(tool: Tool, arguments: Mapping[str, Any], *, timeout_s: float, max_chars: int) -> ToolResult:
    """Run ``tool`` on checked ``arguments`` under ``timeout_s``: ``ok`` with its rendered output, or the call's
    failure as a result the model reads (``TimeLimitExceeded``, ``Error`` with the exception); an
    :class:`InfrastructureError` it raises propagates (not the call's fault). Also behind ``agentrl mcp serve``."""
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            value = await tool(**arguments)
    except TimeoutError:
        return ToolResult(tool.name, "TimeLimitExceeded", f"Error: {tool.name} did not finish within {timeout_s:g}s",
                          time.monotonic() - t0)
    except InfrastructureError:
        raise
    except Exception as exc:  # noqa: BLE001  (any failure of the tool on these arguments: the model reads why)
        return ToolResult(tool.name, "Error", f"Error: {type(exc).__name__}: {exc}", time.monotonic() - t0)
    return ToolResult(tool.name, "ok", render_tool_output(value, max_chars), time.monotonic() - t0)


def _resolve_tool(t: Tool | str) -> Tool:
    if isinstance(t, Tool):
        return t
    from agentrl.env.registry import default_registry

    default_registry.load_plugins()
    if t not in default_registry.tools:
        raise ConfigError(f"unknown tool {t!r}; registered: {', '.join(sorted(default_registry.tools)) or 'none'}")
    return default_registry.tools[t]
