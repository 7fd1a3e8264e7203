"""``@agentrl.tool``: a typed Python function (sync or async) becomes a tool with a JSON schema.

The name is the function's name, the description the docstring's first paragraph, and the parameters' JSON
schema comes from the signature's type hints (parameter descriptions from a Google-style ``Args:`` section).
"""

from __future__ import annotations

import asyncio
import inspect
import re
import types
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, overload

from agentrl.errors import ConfigError

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
                               dict: "object", tuple: "array"}


@dataclass(frozen=True, slots=True)
class Tool:
    """A callable tool and its OpenAI-style function schema."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    fn: Callable[..., Any]
    is_async: bool

    def schema(self) -> dict[str, Any]:
        """The OpenAI/Hermes function-calling schema of this tool."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    async def __call__(self, **arguments: Any) -> Any:
        """Run the tool (sync tools in a worker thread, so the event loop never blocks)."""
        if self.is_async:
            return await self.fn(**arguments)
        return await asyncio.to_thread(self.fn, **arguments)

    def validate(self, arguments: Any) -> dict[str, Any]:
        """Check call arguments against the schema; raise ``ValueError`` with a message the model can read."""
        if not isinstance(arguments, dict):
            raise ValueError(f"arguments of {self.name} must be a JSON object, got {type(arguments).__name__}")
        props = self.parameters.get("properties", {})
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        unknown = [k for k in arguments if k not in props]
        if missing or unknown:
            raise ValueError(
                f"{self.name} expects arguments {sorted(props)} (required {self.parameters.get('required', [])}); "
                f"missing {missing}, unknown {unknown}"
            )
        for key, value in arguments.items():
            expected = props[key].get("type")
            if expected and not _matches(value, expected):
                raise ValueError(f"{self.name}: argument {key!r} must be {expected}, got {type(value).__name__}")
        return arguments


def _matches(value: Any, expected: str) -> bool:
    if expected == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if expected == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    checks = {"string": str, "boolean": bool, "array": list, "object": dict}
    return isinstance(value, checks[expected]) if expected in checks else True


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...
@overload
def tool(*, name: str | None = None, description: str | None = None) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None, /, *, name: str | None = None, description: str | None = None
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Decorator: turn a typed function into a :class:`Tool` (usable as ``@tool`` or ``@tool(name=...)``)."""

    def wrap(f: Callable[..., Any]) -> Tool:
        return make_tool(f, name=name, description=description)

    return wrap(fn) if fn is not None else wrap


def make_tool(fn: Callable[..., Any], *, name: str | None = None, description: str | None = None) -> Tool:
    doc = inspect.getdoc(fn) or ""
    summary, arg_docs = _parse_docstring(doc)
    hints = typing.get_type_hints(fn)
    props: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ConfigError(f"tool {fn.__name__}: *args/**kwargs cannot be described by a JSON schema")
        prop = _json_schema(hints.get(pname, str))
        if pname in arg_docs:
            prop["description"] = arg_docs[pname]
        if param.default is inspect.Parameter.empty:
            required.append(pname)
        else:
            prop["default"] = param.default
        props[pname] = prop
    return Tool(
        name=name or fn.__name__,
        description=description or summary or fn.__name__,
        parameters={"type": "object", "properties": props, "required": required},
        fn=fn,
        is_async=inspect.iscoroutinefunction(fn),
    )


def _json_schema(hint: Any) -> dict[str, Any]:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _json_schema(args[0]) if len(args) == 1 else {"anyOf": [_json_schema(a) for a in args]}
    if origin is typing.Literal:
        values = list(typing.get_args(hint))
        return {"type": _JSON_TYPES.get(type(values[0]), "string"), "enum": values}
    if origin in (list, tuple, set, frozenset):
        args = typing.get_args(hint)
        return {"type": "array", "items": _json_schema(args[0])} if args else {"type": "array"}
    if origin is dict:
        return {"type": "object"}
    return {"type": _JSON_TYPES.get(hint, "string")}


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    summary = doc.split("\n\n", 1)[0].strip().replace("\n", " ")
    args: dict[str, str] = {}
    match = re.search(r"^(?:Args|Arguments|Parameters):\s*\n(.*?)(?:\n\S|\Z)", doc, re.S | re.M)
    if match:
        for line in match.group(1).splitlines():
            m = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?:\s*(.+)", line)
            if m:
                args[m.group(1)] = m.group(2).strip()
    return summary, args


ToolFn = Callable[..., Any] | Callable[..., Awaitable[Any]]
