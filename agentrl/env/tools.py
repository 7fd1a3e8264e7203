"""``@agentrl.tool``: a typed Python function (sync or async) becomes a tool with a JSON schema.

The name is the function's name, the description the docstring's first paragraph, and the parameters' JSON
schema comes from the signature's type hints (parameter descriptions from a Google-style ``Args:`` section).
Both the schema and the argument check come from one pydantic model built from the signature, so what the model
is told and what is accepted cannot drift apart: ``Literal``, ``Enum``, nested pydantic models and dataclasses,
``list[float]``, ``dict[str, int]``, ``X | None``, defaults and ``Annotated[int, Field(ge=1)]`` constraints all
hold in both. Arguments are checked strictly as JSON (``"1"`` is not an integer; ``1`` is a valid number), and
a failed check is a :class:`ToolArgumentsError` (a ``ValueError``) whose message names each bad argument, what
was expected and what came: it is the model's mistake, shown to the model as the tool's answer.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, overload

from pydantic import BaseModel, ConfigDict, Field, PydanticSchemaGenerationError, ValidationError, create_model
from pydantic.json_schema import GenerateJsonSchema

from agentrl.errors import ConfigError


class ToolArgumentsError(ValueError):
    """The arguments of a tool call do not fit the tool's signature (the model's mistake, never infrastructure)."""


@dataclass(frozen=True, slots=True)
class Tool:
    """A callable tool and its OpenAI-style function schema.

    ``arguments_model`` is the pydantic model built from the signature: ``parameters`` is its JSON schema and
    :meth:`validate` checks call arguments against it (field ``i`` is the parameter named by its alias)."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    fn: Callable[..., Any]
    is_async: bool
    arguments_model: type[BaseModel] = field(repr=False, compare=False)
    strict: bool = True

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
        """The call's arguments checked and converted (nested models built, enum values made members, arrays
        made tuples where the signature says so); raise :class:`ToolArgumentsError` with a message the model
        can read."""
        if not isinstance(arguments, dict):
            raise ToolArgumentsError(f"the arguments of {self.name} must be a JSON object "
                                     f"({self._signature()}), got {_shown(arguments)}")
        try:
            try:
                text = json.dumps(arguments)
            except (TypeError, ValueError):  # not JSON (a Python caller's objects): check them as Python values
                checked = self.arguments_model.model_validate(arguments, strict=self.strict)
            else:
                checked = self.arguments_model.model_validate_json(text, strict=self.strict)
        except ValidationError as exc:
            raise ToolArgumentsError(self._explain(exc)) from None
        # only the arguments the call gave: the function's own defaults apply to the rest, as in a Python call
        given = checked.model_fields_set
        return {f.alias or attr: getattr(checked, attr)
                for attr, f in type(checked).model_fields.items() if attr in given}

    def _signature(self) -> str:
        props = self.parameters.get("properties", {})
        required = set(self.parameters.get("required", []))
        return f"{self.name}({', '.join(p if p in required else p + '=…' for p in props)})"

    def _explain(self, exc: ValidationError) -> str:
        props = list(self.parameters.get("properties", {}))
        lines = []
        for err in exc.errors(include_url=False):
            where = _location(err["loc"])
            if err["type"] == "missing":
                lines.append(f"argument {where} is missing")
            elif err["type"] == "extra_forbidden":
                lines.append(f"unknown argument {where} (accepted: {', '.join(props) or 'none'})")
            else:
                expected = str(err["msg"]).removeprefix("Input should be ")
                lines.append(f"argument {where}: expected {expected}, got {_shown(err.get('input'))}")
        return f"invalid arguments for {self._signature()}: " + "; ".join(lines)


def _location(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as the model wrote it: ``'point.x'``, ``'values[1]'``."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return repr(text)


def _shown(value: Any, limit: int = 80) -> str:
    """A value as JSON (what the model wrote), capped."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


class _NoFieldTitles(GenerateJsonSchema):
    """Pydantic's schema without the per-field ``title`` (the parameter name again): what function schemas
    look like in OpenAI's and the chat templates' examples."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...
@overload
def tool(*, name: str | None = None, description: str | None = None,
         strict: bool = True) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None, /, *, name: str | None = None, description: str | None = None,
    strict: bool = True,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Decorator: turn a typed function into a :class:`Tool` (usable as ``@tool`` or ``@tool(name=...)``).

    ``strict=False`` lets pydantic's lax conversions through (``"1"`` for an integer, ``1.0`` for an integer).
    The decorator does not register the tool: pass it to ``register_env(..., tools=[...])`` or
    ``register_tool`` to make it known by name."""

    def wrap(f: Callable[..., Any]) -> Tool:
        return make_tool(f, name=name, description=description, strict=strict)

    return wrap(fn) if fn is not None else wrap


def make_tool(fn: Callable[..., Any], *, name: str | None = None, description: str | None = None,
              strict: bool = True) -> Tool:
    """Build a :class:`Tool` from ``fn``'s signature and docstring (raises ConfigError for what JSON schema
    cannot describe: ``*args``, ``**kwargs``, a type pydantic does not know)."""
    tool_name = name or fn.__name__
    summary, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as exc:  # noqa: BLE001  (an unresolvable annotation: say which tool)
        raise ConfigError(f"tool {tool_name}: cannot resolve its type hints ({exc}); define the types at module "
                          "level") from exc
    fields: dict[str, Any] = {}
    for i, (pname, param) in enumerate(inspect.signature(fn).parameters.items()):
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ConfigError(f"tool {tool_name}: *args/**kwargs cannot be described by a JSON schema")
        if param.kind is param.POSITIONAL_ONLY:
            raise ConfigError(f"tool {tool_name}: parameter {pname!r} is positional-only; tools are called "
                              "with keyword arguments")
        default = ... if param.default is inspect.Parameter.empty else param.default
        # internal field names p0, p1, ... with the parameter name as alias: any parameter name works, even one
        # that is a BaseModel attribute (``json``, ``schema``, ``copy``) or starts with an underscore
        fields[f"p{i}"] = (hints.get(pname, Any),
                           Field(default, alias=pname, description=arg_docs.get(pname)))
    try:
        model = create_model(f"{tool_name}_arguments", __config__=ConfigDict(extra="forbid"), **fields)
        parameters = model.model_json_schema(schema_generator=_NoFieldTitles)
    except (PydanticSchemaGenerationError, TypeError, ValueError) as exc:
        raise ConfigError(f"tool {tool_name}: its parameters cannot be described as JSON ({exc}); use JSON "
                          "types, Literal, Enum, pydantic models or dataclasses") from exc
    parameters.pop("title", None)
    parameters.setdefault("required", [])
    return Tool(
        name=tool_name,
        description=description or summary or tool_name,
        parameters=parameters,
        fn=fn,
        is_async=inspect.iscoroutinefunction(fn),
        arguments_model=model,
        strict=strict,
    )


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
