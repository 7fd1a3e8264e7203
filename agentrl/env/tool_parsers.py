"""Reading tool calls out of a model's turn: agentrl's own ``<tool_call>`` parser or one of SGLang's.

A parser turns the text of one model turn into :class:`ParsedCall` values, in order, ``[]`` when the turn calls
nothing. It never raises on the model's text: a call it cannot read is a ``ParsedCall`` with ``error`` set (the
model's mistake, shown to the model). Which parser an environment uses is its ``tool_parser`` option:

- ``"builtin"`` (the default): the Hermes / Qwen 2.5 / SmolLM2 format,
  ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` with or without newlines inside the tags, one error
  per malformed block. Pure Python, no SGLang import.
- any name of SGLang's function-call parsers (its ``--tool-call-parser`` names: ``qwen25``, ``hermes``,
  ``llama3``, ``mistral``, ``deepseekv3``, ``pythonic``, …): that SGLang detector, see
  :mod:`agentrl.env.sglang_parsers` (imported only when such a parser first reads a turn).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from agentrl.env.tools import Tool

BUILTIN = "builtin"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One tool call of a model turn. ``error`` is set (and name/arguments may be empty) when it is malformed."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""
    error: str | None = None


class ToolParser(Protocol):
    """Reads the tool calls of one model turn; never raises on the model's text."""

    @property
    def name(self) -> str:
        """The ``tool_parser`` name it was made from."""
        ...

    def parse(self, text: str) -> list[ParsedCall]:
        """Every call of ``text``, in order; ``[]`` if the turn calls no tool."""
        ...


def make_tool_parser(name: str, tools: Sequence[Tool | Mapping[str, Any]]) -> ToolParser:
    """The parser called ``name`` for an environment offering ``tools`` (:class:`Tool` objects or their OpenAI
    function schemas, as the agent gateway receives them). Raises ConfigError for an unknown name
    or, for SGLang's parsers, when the ``sglang`` package is not installed (checked without importing it)."""
    if name == BUILTIN:
        return BuiltinToolParser()
    from agentrl.env.sglang_parsers import SGLangToolParser

    return SGLangToolParser(name, tools)


@dataclass(frozen=True, slots=True)
class BuiltinToolParser:
    """agentrl's parser of ``<tool_call>{json}</tool_call>`` blocks (see :func:`parse_tool_calls`)."""

    name: str = BUILTIN

    def parse(self, text: str) -> list[ParsedCall]:
        return parse_tool_calls(text)


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
