"""Environments and tools: the Python API researchers extend."""

from agentrl.env.base import Environment, Observation, StepResult
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
from agentrl.env.tools import Tool, tool

__all__ = [
    "Environment", "Observation", "StepResult", "EnvResources", "EnvSpec", "Registry",
    "default_registry", "list_envs", "list_tools", "register_env", "register_tool", "Tool", "tool",
]


def _register_builtins() -> None:
    from agentrl.env.retool import ReToolEnv

    default_registry.register_env("retool", ReToolEnv, description="Math with a Python code interpreter (ReTool).")


_register_builtins()
