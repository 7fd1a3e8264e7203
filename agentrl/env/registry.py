"""Registries of environments and tools: plain dicts by name, plus plugins from entry points.

``register_env(name, factory)`` records a factory called as ``factory(resources, **options)`` per episode, where
``resources`` (:class:`EnvResources`) carries what environments share (the sandbox, reward workers). A plugin
is an entry point in the group ``agentrl.plugins`` whose target is a module (imported: its decorators register)
or a callable taking the :class:`Registry`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from agentrl.env.base import Environment
from agentrl.env.tools import Tool
from agentrl.errors import ConfigError

logger = logging.getLogger(__name__)

PLUGIN_GROUP = "agentrl.plugins"


@dataclass(frozen=True, slots=True)
class EnvResources:
    """Shared, long-lived resources handed to every environment instance (wired once per process)."""

    sandbox: Any = None  # agentrl.sandbox.base.Sandbox
    verifier: Any = None  # agentrl.rewards.MathVerifier: the process's math-checking pool
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EnvSpec:
    name: str
    factory: Callable[..., Environment]
    description: str = ""
    tools: tuple[str, ...] = ()


class Registry:
    """Environments and tools by name."""

    def __init__(self) -> None:
        self.envs: dict[str, EnvSpec] = {}
        self.tools: dict[str, Tool] = {}
        self._plugins_loaded = False

    def register_env(self, name: str, factory: Callable[..., Environment] | str, *, description: str = "",
                     tools: Iterable[str | Tool] = ()) -> EnvSpec:
        if not name or not isinstance(name, str):
            raise ConfigError(f"environment name must be a non-empty string, got {name!r}")
        fn = _resolve(factory) if isinstance(factory, str) else factory
        tool_names = []
        for t in tools:
            if isinstance(t, Tool):
                self.register_tool(t)
                tool_names.append(t.name)
            else:
                tool_names.append(t)
        doc = description or (fn.__doc__ or "").strip().split("\n", 1)[0]
        spec = EnvSpec(name=name, factory=fn, description=doc, tools=tuple(tool_names))
        self.envs[name] = spec
        return spec

    def register_tool(self, tool: Tool) -> Tool:
        self.tools[tool.name] = tool
        return tool

    def make_env(self, name: str, resources: EnvResources, **options: Any) -> Environment:
        spec = self.get_env(name)
        try:
            return spec.factory(resources, **options)
        except TypeError as exc:
            raise ConfigError(f"environment {name!r} rejected its options {sorted(options)}: {exc}") from exc

    def get_env(self, name: str) -> EnvSpec:
        self.load_plugins()
        if name not in self.envs:
            raise ConfigError(f"unknown environment {name!r}; registered: {', '.join(sorted(self.envs)) or 'none'}")
        return self.envs[name]

    def list_envs(self) -> list[EnvSpec]:
        self.load_plugins()
        return [self.envs[k] for k in sorted(self.envs)]

    def list_tools(self) -> list[Tool]:
        self.load_plugins()
        return [self.tools[k] for k in sorted(self.tools)]

    def load_plugins(self) -> None:
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP):
            try:
                target = ep.load()
            except Exception as exc:  # a broken plugin must not break agentrl; say which and why
                logger.error("agentrl plugin %s (%s) failed to load: %r", ep.name, ep.value, exc)
                continue
            if callable(target) and not isinstance(target, type):
                target(self)


def _resolve(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    if not attr:
        raise ConfigError(f"expected 'module:attribute', got {ref!r}")
    try:
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot import {ref!r}: {exc}") from exc
    return obj


#: The process-wide default registry behind ``agentrl.register_env`` / ``agentrl.tool`` registration.
default_registry = Registry()


def register_env(name: str, factory: Callable[..., Environment] | str | None = None, *, description: str = "",
                 tools: Iterable[str | Tool] = ()) -> Any:
    """Register an environment factory by name; usable as a call or as a class decorator."""
    if factory is None:
        def deco(cls: Callable[..., Environment]) -> Callable[..., Environment]:
            default_registry.register_env(name, cls, description=description, tools=tools)
            return cls
        return deco
    return default_registry.register_env(name, factory, description=description, tools=tools)


def register_tool(t: Tool) -> Tool:
    return default_registry.register_tool(t)


def list_envs() -> list[EnvSpec]:
    return default_registry.list_envs()


def list_tools() -> list[Tool]:
    return default_registry.list_tools()
