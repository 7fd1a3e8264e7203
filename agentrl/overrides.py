"""A config as the command line reads it: a YAML mapping, then ``key=value`` overrides (dotted keys, YAML values).

Shared by the run config (:mod:`agentrl.launcher.config`) and the eval spec (``agentrl eval``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from agentrl.errors import ConfigError


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["rollout.n_samples=4", "model=tiny"]`` → a nested dict; values are parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. rollout.n_samples=4)")
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with another override of {p!r}")
        node[parts[-1]] = yaml.safe_load(raw) if raw else ""
    return out


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``, mappings merged key by key (neither is modified)."""
    merged = dict(base)
    for k, v in over.items():
        merged[k] = merge(merged[k], v) if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
    return merged


def read_mapping(path: Path, what: str = "config file") -> dict[str, Any]:
    """The YAML (or JSON) mapping in ``path``; an empty file is an empty mapping."""
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist")
    loaded = yaml.safe_load(path.read_text()) or {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(loaded).__name__}")
    return loaded
