import pytest

import agentrl
from agentrl.env.registry import EnvResources, Registry
from agentrl.env.tools import tool
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


def test_schema_from_signature_and_docstring():
    assert add.name == "add" and add.description == "Add two integers."
    assert add.parameters == {
        "type": "object",
        "properties": {"a": {"type": "integer", "description": "the first addend"},
                       "b": {"type": "integer", "description": "the second addend", "default": 2}},
        "required": ["a"],
    }
    assert fetch.name == "lookup" and fetch.is_async
    assert fetch.parameters["properties"]["keys"] == {"type": "array", "items": {"type": "string"}, "default": None}
    assert fetch.parameters["required"] == ["key"]


async def test_sync_and_async_tools_run():
    assert await add(a=1) == 3
    assert await fetch(key="x") == "X"


def test_validation_messages_name_the_problem():
    with pytest.raises(ValueError, match="missing \\['a'\\]"):
        add.validate({"b": 1})
    with pytest.raises(ValueError, match="must be integer"):
        add.validate({"a": "1"})
    with pytest.raises(ValueError, match="JSON object"):
        add.validate([1])


def test_registry_unknown_env_lists_known_ones():
    reg = Registry()
    reg.register_env("mine", lambda resources, **o: None, tools=[add])
    with pytest.raises(ConfigError, match="registered: mine"):
        reg.get_env("nope")
    assert [t.name for t in reg.list_tools()] == ["add"]


def test_public_api_exports():
    for name in ("tool", "register_env", "Environment", "list_tools", "list_envs"):
        assert hasattr(agentrl, name), name
    assert "retool" in [e.name for e in agentrl.list_envs()]
    assert isinstance(EnvResources(), EnvResources)
