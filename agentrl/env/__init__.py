"""Environments and tools: the Python API researchers extend."""

from agentrl.env.base import Environment, Observation, StepResult, prompt_messages
from agentrl.env.hermes import ToolCallingEnv
from agentrl.env.registry import (
    EnvResources,
    EnvSpec,
    Registry,
    default_registry,
    list_envs,
    list_tools,
    register_env,
    register_tool,
)
from agentrl.env.tool_parsers import ParsedCall, ToolParser, make_tool_parser, parse_tool_calls
from agentrl.env.tools import Tool, ToolArgumentsError, tool

__all__ = [
    "EnvResources",
    "EnvSpec",
    "Environment",
    "Observation",
    "ParsedCall",
    "Registry",
    "StepResult",
    "Tool",
    "ToolArgumentsError",
    "ToolCallingEnv",
    "ToolParser",
    "default_registry",
    "list_envs",
    "list_tools",
    "make_tool_parser",
    "parse_tool_calls",
    "prompt_messages",
    "register_env",
    "register_tool",
    "tool",
]


def _register_builtins() -> None:
    from agentrl.env.code_tests import CodeTestsEnv
    from agentrl.env.math import MathEnv
    from agentrl.env.retool import ReToolEnv

    default_registry.register_env("retool", ReToolEnv, description="Math with a Python code interpreter (ReTool).")
    default_registry.register_env("math", MathEnv, description="Math in one turn, no tools; \\boxed{} answer checked.")
    default_registry.register_env("code_tests", CodeTestsEnv,
                                  description="A Python program in one turn, scored by its tests in the sandbox.")


_register_builtins()
