"""``@agentrl.tool``: the function schema from the signature and docstring, argument validation through the
pydantic model built from the signature (the same model that gives the schema), and the registries' one-name-
one-thing rule with ``replace=True``."""

from __future__ import annotations

import dataclasses
import enum
import sys
import textwrap
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

import agentrl
from agentrl.env.registry import EnvResources, Registry
from agentrl.env.tools import ToolArgumentsError, tool
from agentrl.errors import ConfigError


@tool
def add(a: int, b: int = 2) -> int:
    """Add two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


@tool(name="lookup")
async def fetch(key: str, keys: list[str] | None = None) -> str:
    """Look a key up."""
    return key.upper()


class Unit(enum.Enum):
    METRE = "m"
    FOOT = "ft"


class Point(BaseModel):
    x: float
    y: float = 0.0


class Opaque:
    """Not a type pydantic can describe."""


@dataclasses.dataclass
class Box:
    width: int
    height: int


@tool
def draw(mode: Literal["line", "dot"], points: list[Point], unit: Unit = Unit.METRE, limit: int | None = None,
         weights: list[float] = (), counts: dict[str, int] | None = None, box: Box | None = None,
         n: Annotated[int, Field(ge=1, le=10)] = 1, json: str = "") -> dict:
    """Draw points.

    Args:
        mode: how to draw
        points: where
        unit: the unit of the coordinates
    """
    return {"mode": mode, "points": points, "unit": unit, "limit": limit, "weights": weights, "counts": counts,
            "box": box, "n": n, "json": json}


# -- schema ---------------------------------------------------------------------------------------------------

def test_schema_from_signature_and_docstring():
    assert add.name == "add" and add.description == "Add two integers."
    assert add.schema() == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "description": "the first addend"},
                           "b": {"type": "integer", "description": "the second addend", "default": 2}},
            "required": ["a"],
            "additionalProperties": False,
        }}}
    assert fetch.name == "lookup" and fetch.is_async and fetch.description == "Look a key up."
    assert fetch.parameters["properties"]["keys"] == {
        "anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}], "default": None}
    assert fetch.parameters["required"] == ["key"]


def test_schema_of_rich_types():
    props = draw.parameters["properties"]
    assert props["mode"] == {"type": "string", "enum": ["line", "dot"], "description": "how to draw"}
    assert props["points"]["items"] == {"$ref": "#/$defs/Point"}
    assert draw.parameters["$defs"]["Point"]["required"] == ["x"]
    assert draw.parameters["$defs"]["Unit"]["enum"] == ["m", "ft"] and props["unit"]["default"] == "m"
    assert props["counts"]["anyOf"][0] == {"type": "object", "additionalProperties": {"type": "integer"}}
    assert props["n"] == {"type": "integer", "minimum": 1, "maximum": 10, "default": 1}
    assert "json" in props  # a parameter named like a BaseModel attribute
    assert draw.parameters["required"] == ["mode", "points"]


def test_what_a_json_schema_cannot_describe_is_refused_when_the_tool_is_made():
    def star(*values: int) -> int:
        return 0

    class Local:
        pass

    def local(x: Local) -> None: ...

    def opaque(x: Opaque) -> None: ...

    with pytest.raises(ConfigError, match=r"star: \*args"):
        tool(star)
    with pytest.raises(ConfigError, match="opaque: its parameters cannot be described as JSON"):
        tool(opaque)
    with pytest.raises(ConfigError, match="local: cannot resolve its type hints .*'Local'.* module level"):
        tool(local)


# -- validation -----------------------------------------------------------------------------------------------

def test_the_three_old_holes_are_closed():
    with pytest.raises(ToolArgumentsError, match=r"argument 'mode': expected 'line' or 'dot', got \"z\""):
        draw.validate({"mode": "z", "points": []})
    with pytest.raises(ToolArgumentsError, match=r"argument 'weights\[0\]': expected a valid number, got \"a\""):
        draw.validate({"mode": "dot", "points": [], "weights": ["a"]})
    assert draw.validate({"mode": "dot", "points": [], "limit": None})["limit"] is None


def test_valid_arguments_are_converted_to_the_signatures_types():
    args = draw.validate({"mode": "dot", "points": [{"x": 1, "y": 2.5}, {"x": 3}], "unit": "ft", "limit": 4,
                          "weights": [1, 0.5], "counts": {"a": 1}, "box": {"width": 2, "height": 3}, "n": 10,
                          "json": "{}"})
    assert args["points"] == [Point(x=1.0, y=2.5), Point(x=3.0)] and isinstance(args["points"][0], Point)
    assert args["unit"] is Unit.FOOT and args["box"] == Box(2, 3) and args["weights"] == [1.0, 0.5]
    assert args["limit"] == 4 and args["counts"] == {"a": 1} and args["json"] == "{}"


def test_defaults_are_the_functions_own():
    assert draw.validate({"mode": "line", "points": []}) == {"mode": "line", "points": []}  # nothing added
    assert add.validate({"a": 1}) == {"a": 1}


@pytest.mark.parametrize("arguments, says", [
    ({"b": 1}, "argument 'a' is missing"),
    ({"a": 1, "c": 3}, "unknown argument 'c' (accepted: a, b)"),
    ({"a": "1"}, "argument 'a': expected a valid integer, got \"1\""),  # strict: a string is not an integer
    ({"a": 1.5}, "argument 'a': expected a valid integer, got 1.5"),
    ({"a": True}, "argument 'a': expected a valid integer, got true"),
    ({"a": None}, "argument 'a': expected a valid integer, got null"),
])
def test_validation_messages_name_the_argument_what_was_expected_and_what_came(arguments, says):
    with pytest.raises(ToolArgumentsError) as err:
        add.validate(arguments)
    assert says in str(err.value) and str(err.value).startswith("invalid arguments for add(a, b=…)")


@pytest.mark.parametrize("arguments, says", [
    ({"mode": "dot", "points": [{"y": 1}]}, "argument 'points[0].x' is missing"),
    ({"mode": "dot", "points": [{"x": "1"}]}, "argument 'points[0].x': expected a valid number, got \"1\""),
    ({"mode": "dot", "points": [], "unit": "km"}, "argument 'unit': expected 'm' or 'ft', got \"km\""),
    ({"mode": "dot", "points": [], "counts": {"a": "x"}}, "argument 'counts.a': expected a valid integer"),
    ({"mode": "dot", "points": [], "n": 0}, "argument 'n': expected greater than or equal to 1, got 0"),
    ({"mode": "dot", "points": [], "box": {"width": 1}}, "argument 'box.height' is missing"),
    ({"mode": "dot", "points": {"x": 1}}, "argument 'points': expected a valid array, got {\"x\": 1}"),
])
def test_nested_and_constrained_arguments(arguments, says):
    with pytest.raises(ToolArgumentsError) as err:
        draw.validate(arguments)
    assert says in str(err.value)


def test_every_bad_argument_is_reported_at_once():
    with pytest.raises(ToolArgumentsError) as err:
        add.validate({"a": "x", "b": "y", "c": 1})
    assert [p.split(":")[0] for p in str(err.value).split(": ", 1)[1].split("; ")] == [
        "argument 'a'", "argument 'b'", "unknown argument 'c' (accepted"]


def test_arguments_must_be_an_object():
    with pytest.raises(ToolArgumentsError, match=r"arguments of add must be a JSON object \(add\(a, b=…\)\), got \[1\]"):
        add.validate([1])
    assert isinstance(ToolArgumentsError("x"), ValueError)  # the env's contract: a ValueError


def test_lax_tools_accept_conversions():
    @tool(strict=False)
    def half(n: int) -> float:
        """Half of n."""
        return n / 2

    assert half.validate({"n": "4"}) == {"n": 4}
    with pytest.raises(ToolArgumentsError, match="expected a valid integer"):
        half.validate({"n": "four"})


async def test_sync_and_async_tools_run_with_validated_arguments():
    assert await add(**add.validate({"a": 1})) == 3
    assert await fetch(**fetch.validate({"key": "x"})) == "X"
    out = await draw(**draw.validate({"mode": "dot", "points": [{"x": 1}], "unit": "ft"}))
    assert out["points"] == [Point(x=1.0)] and out["unit"] is Unit.FOOT and out["n"] == 1


# -- registries -----------------------------------------------------------------------------------------------

def make_env(resources, **options):
    return None


def other_env(resources, **options):
    return None


def test_registry_unknown_env_lists_known_ones():
    reg = Registry()
    reg.register_env("mine", make_env, tools=[add])
    with pytest.raises(ConfigError, match="registered: mine"):
        reg.get_env("nope")
    assert [t.name for t in reg.list_tools()] == ["add"]


def test_a_name_is_bound_once_unless_replace():
    reg = Registry()
    spec = reg.register_env("mine", make_env, tools=[add])
    assert reg.register_env("mine", make_env, tools=[add]) == spec  # the same registration again: a no-op
    with pytest.raises(ConfigError, match=r"environment 'mine' is already registered by .*make_env .*"
                                          r"other_env .* under the same name needs replace=True"):
        reg.register_env("mine", other_env)
    assert reg.get_env("mine").factory is make_env
    assert reg.register_env("mine", other_env, replace=True).factory is other_env

    @tool(name="add")
    def add_floats(a: float, b: float) -> float:
        """Add two numbers."""
        return a + b

    with pytest.raises(ConfigError, match="tool 'add' is already registered by .*add_floats.* needs replace=True"):
        reg.register_tool(add_floats)
    with pytest.raises(ConfigError, match="tool 'add' is already registered"):
        reg.register_env("floats", make_env, tools=[fetch, add_floats])
    assert "floats" not in reg.envs and "lookup" not in reg.tools  # a refused registration registers nothing
    reg.register_tool(add_floats, replace=True)
    assert reg.tools["add"] is add_floats
    assert reg.register_tool(add_floats) is add_floats  # the same object again: a no-op


def test_a_definition_executed_again_replaces_its_first_run(tmp_path, monkeypatch):
    """A module imported a second time (another name for the same file, a reload, a plugin re-imported) makes
    new objects from the same source: that is the same definition, not a clash."""
    source = tmp_path / "agentrl_twice.py"
    source.write_text(textwrap.dedent('''
        import agentrl
        from agentrl.env.registry import Registry

        REG = None

        @agentrl.tool
        def shout(text: str) -> str:
            """Upper-case the text."""
            return text.upper()

        class TwiceEnv:
            def __init__(self, resources, **options): ...

        def register(reg):
            reg.register_env("twice", TwiceEnv, tools=[shout])
        '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry()
    import agentrl_twice as first

    first.register(reg)
    monkeypatch.delitem(sys.modules, "agentrl_twice")
    import agentrl_twice as second

    assert second.TwiceEnv is not first.TwiceEnv
    second.register(reg)  # no error
    assert reg.get_env("twice").factory is second.TwiceEnv and reg.tools["shout"] is second.shout
    monkeypatch.delitem(sys.modules, "agentrl_twice")


def test_public_api_exports():
    for name in ("tool", "register_env", "Environment", "list_tools", "list_envs"):
        assert hasattr(agentrl, name), name
    assert "retool" in [e.name for e in agentrl.list_envs()]
    assert agentrl.env.EnvResources is EnvResources
    # every resource is optional: an environment can be built without a sandbox or a checker (as unit tests do)
    assert EnvResources() == EnvResources(sandbox=None, verifier=None, extra={})
    with pytest.raises(ConfigError, match="environment 'math' is already registered"):
        agentrl.register_env("math", make_env)  # a built-in is not shadowed by accident
