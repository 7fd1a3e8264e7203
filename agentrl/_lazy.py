"""Public names of a package loaded on first use (PEP 562), so importing one light module of a package (its config,
its contract) does not import the rest: the rollout process reads the trainer's config without torch, the trainer
process reads the rollout's without rollout code."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, homes: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, whose public name ``n`` lives in ``package.homes[n]``."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{homes[name]}"), name)

    def __dir__() -> list[str]:
        return sorted(homes)

    return __getattr__, __dir__
