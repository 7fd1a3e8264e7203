"""Hermes / Qwen tool calling: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` in the model's turn,
results in the chat template's ``tool`` role.

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
from dataclasses import dataclass, field
from typing import Any, ClassVar

from agentrl.env.base import Environment, Observation, StepResult, prompt_messages
from agentrl.env.registry import EnvResources
from agentrl.env.tools import Tool
from agentrl.errors import ConfigError, InfrastructureError
from agentrl.types import Task, ToolCall, ToolResult

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One ``<tool_call>`` block. ``error`` is set (and name/arguments may be empty) when it is malformed."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""
    error: str | None = None


def parse_tool_calls(text: str) -> list[ParsedCall]:
    """Every ``<tool_call>…</tool_call>`` block of one model turn, in order; ``[]`` if the turn has none.

    The body must be a JSON object with a string ``name`` and an object ``arguments`` (a JSON string holding an
    object is accepted too, as some models write it). An unclosed block, a stray ``</tool_call>`` or a nested
    ``<tool_call>`` is malformed (and ends the parse).
    """
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        start, close = text.find(TOOL_CALL_OPEN, pos), text.find(TOOL_CALL_CLOSE, pos)
        if start < 0:
            if close >= 0:
                calls.append(ParsedCall("", raw=text[pos: close + len(TOOL_CALL_CLOSE)],
                                        error="found </tool_call> without an opening <tool_call>"))
            return calls
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        if end < 0:
            calls.append(ParsedCall("", raw=text[start:], error="the <tool_call> block is not closed with </tool_call>"))
            return calls
        raw = text[start: end + len(TOOL_CALL_CLOSE)]
        body = text[body_start:end]
        if TOOL_CALL_OPEN in body:
            calls.append(ParsedCall("", raw=raw, error="nested <tool_call> tags: close each call before the next"))
            return calls
        calls.append(_parse_body(body, raw))
        pos = end + len(TOOL_CALL_CLOSE)


def _parse_body(body: str, raw: str) -> ParsedCall:
    expected = 'expected {"name": "<tool name>", "arguments": {...}}'
    try:
        obj = json.loads(body)
    except ValueError as exc:
        return ParsedCall("", raw=raw, error=f"the tool call is not valid JSON ({exc}); {expected}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ParsedCall("", raw=raw, error=f"the tool call has no \"name\"; {expected}")
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass
    if not isinstance(args, dict):
        return ParsedCall(obj["name"], raw=raw, error=f"\"arguments\" must be a JSON object; {expected}")
    return ParsedCall(obj["name"], args, raw)


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
                 tool_timeout_s: float = 30.0, max_output_chars: int = 2048) -> None:
        self.resources = resources
        self.max_tool_calls = max_tool_calls
        self.tool_timeout_s = tool_timeout_s
        self.max_output_chars = max_output_chars
        self._tools = {t.name: t for t in (*self.tools, *(_resolve_tool(t) for t in tools))}
        if not self._tools:
            raise ConfigError(f"{type(self).__name__} has no tools: set the class attribute `tools` or pass tools=")
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
        parsed = parse_tool_calls(text)
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
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.tool_timeout_s):
                value = await tool(**arguments)
        except TimeoutError:
            return ToolResult(tool.name, "TimeLimitExceeded",
                              f"Error: {tool.name} did not finish within {self.tool_timeout_s:g}s",
                              time.monotonic() - t0)
        except InfrastructureError:
            raise
        except Exception as exc:  # noqa: BLE001  (any failure of the tool on these arguments: the model reads why)
            return ToolResult(tool.name, "Error", f"Error: {type(exc).__name__}: {exc}", time.monotonic() - t0)
        return ToolResult(tool.name, "ok", render_tool_output(value, self.max_output_chars), time.monotonic() - t0)


def _resolve_tool(t: Tool | str) -> Tool:
    if isinstance(t, Tool):
        return t
    from agentrl.env.registry import default_registry

    default_registry.load_plugins()
    if t not in default_registry.tools:
        raise ConfigError(f"unknown tool {t!r}; registered: {', '.join(sorted(default_registry.tools)) or 'none'}")
    return default_registry.tools[t]
