"""Registries of environments and tools: plain dicts by name, plus plugins from entry points.

``register_env(name, factory)`` records a factory called as ``factory(resources, **options)`` per episode, where
``resources`` (:class:`EnvResources`) carries what environments share (the sandbox, reward workers). A plugin
is an entry point in the group ``agentrl.plugins`` whose target is a module (imported: its decorators register)
or a callable taking the :class:`Registry`.

A name is bound once per registry. Registering it again is
- a no-op when it is the same registration (the same factory or tool object, same description and tools: a
  plugin whose setup runs twice);
- a replacement when it is the same definition executed again (same source file, qualified name and, for
  functions, first line: a module imported a second time or reloaded, a notebook cell run again);
- otherwise a :class:`ConfigError` naming both, unless ``replace=True``. Two plugins choosing one name, or a
  user environment named like a built-in, fail loudly instead of shadowing each other.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
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
    factory: Callable[..., Any]  # -> Environment, or an AgentEnv (kind "agent", agentrl.env.agent)
    description: str = ""
    tools: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        """``"agent"`` for an agent function (:mod:`agentrl.env.agent`), else ``"env"`` (an Environment)."""
        return "agent" if getattr(self.factory, "agentrl_kind", None) == "agent" else "env"


class Registry:
    """Environments and tools by name."""

    def __init__(self) -> None:
        self.envs: dict[str, EnvSpec] = {}
        self.tools: dict[str, Tool] = {}
        self._plugins_loaded = False

    def register_env(self, name: str, factory: Callable[..., Any] | str, *, description: str = "",
                     tools: Iterable[str | Tool] = (), replace: bool = False) -> EnvSpec:
        """Bind ``name`` to ``factory`` (and register the :class:`Tool` objects among ``tools``); see the module
        docstring for what happens when the name is taken."""
        if not name or not isinstance(name, str):
            raise ConfigError(f"environment name must be a non-empty string, got {name!r}")
        fn = _resolve(factory) if isinstance(factory, str) else factory
        listed = list(tools)
        new_tools = [t for t in listed if isinstance(t, Tool)]
        doc = description or (fn.__doc__ or "").strip().split("\n", 1)[0]
        spec = EnvSpec(name=name, factory=fn, description=doc,
                       tools=tuple(t.name if isinstance(t, Tool) else t for t in listed))
        old = self.envs.get(name)
        if old == spec and all(self.tools.get(t.name) is t for t in new_tools):
            return old  # the same registration again
        if old is not None and not replace and _origin(old.factory) != _origin(fn):
            raise ConfigError(
                f"environment {name!r} is already registered by {_describe(old.factory)}; registering "
                f"{_describe(fn)} under the same name needs replace=True (or choose another name)")
        if not replace:  # all checks first: a refused registration registers none of its tools
            for t in new_tools:
                self._check_tool_name_free(t)
        for t in new_tools:
            self.tools[t.name] = t
        self.envs[name] = spec
        return spec

    def register_tool(self, tool: Tool, *, replace: bool = False) -> Tool:
        """Bind ``tool.name`` to ``tool``; see the module docstring for what happens when the name is taken."""
        if not replace:
            self._check_tool_name_free(tool)
        self.tools[tool.name] = tool
        return tool

    def _check_tool_name_free(self, tool: Tool) -> None:
        old = self.tools.get(tool.name)
        if old is not None and old is not tool and _origin(old.fn) != _origin(tool.fn):
            raise ConfigError(
                f"tool {tool.name!r} is already registered by {_describe(old.fn)}; registering {_describe(tool.fn)} "
                "under the same name needs replace=True (or @agentrl.tool(name=...) to choose another name)")

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
                if callable(target) and not isinstance(target, type):
                    target(self)
            except Exception as exc:  # a broken plugin (or one whose names clash) must not break agentrl
                logger.error("agentrl plugin %s (%s) failed to load: %r", ep.name, ep.value, exc)


def _origin(obj: Any) -> tuple[str, str, int | None] | None:
    """Where ``obj`` was defined: (source file or module, qualified name, first line for functions). Equal
    origins of two distinct objects mean the same definition executed twice. ``None`` (never equal to another
    origin) for objects without a qualified name, such as ``functools.partial``."""
    obj = inspect.unwrap(obj)  # a decorator's wrapper (functools.wraps) is its function's definition
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(qualname, str):
        return None
    try:
        where = inspect.getfile(obj)
    except (TypeError, OSError):  # defined in __main__ of a notebook or the REPL: no file
        where = str(getattr(obj, "__module__", ""))
    code = getattr(obj, "__code__", None)
    return where, qualname, getattr(code, "co_firstlineno", None)


def _describe(obj: Any) -> str:
    origin = _origin(obj)
    if origin is None:
        return repr(obj)
    where, qualname, line = origin
    return f"{getattr(obj, '__module__', '?')}.{qualname} ({where}{f':{line}' if line else ''})"


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
                 tools: Iterable[str | Tool] = (), replace: bool = False) -> Any:
    """Register an environment factory by name; usable as a call or as a class decorator. A name already
    bound to something else is an error unless ``replace=True`` (see this module's docstring)."""
    if factory is None:
        def deco(cls: Callable[..., Environment]) -> Callable[..., Environment]:
            default_registry.register_env(name, cls, description=description, tools=tools, replace=replace)
            return cls
        return deco
    return default_registry.register_env(name, factory, description=description, tools=tools, replace=replace)


def register_tool(t: Tool, *, replace: bool = False) -> Tool:
    """Register a tool by its name, so environments can name it (``tools=["add"]``)."""
    return default_registry.register_tool(t, replace=replace)


def list_envs() -> list[EnvSpec]:
    return default_registry.list_envs()


def list_tools() -> list[Tool]:
    return default_registry.list_tools()


def load_imports(imports: list[str]) -> None:
    """Import user modules (``pkg.module``) or files (``path/to/file.py``) so their decorators register
    environments and tools in this process. Each file is imported once per process."""
    for ref in imports:
        if ref.endswith(".py"):
            path = Path(ref)
            if not path.exists():
                raise ConfigError(f"imports: {ref} does not exist")
            name = f"agentrl_user_{path.stem}_{abs(hash(str(path.resolve())))}"
            if name in sys.modules:
                continue
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        else:
            try:
                importlib.import_module(ref)
            except ImportError as exc:
                raise ConfigError(f"imports: cannot import {ref!r}: {exc}") from exc
