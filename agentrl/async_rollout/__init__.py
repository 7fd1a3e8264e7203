"""Async multi-turn rollout: episodes (token-in/token-out) and the staleness-bounded scheduler.

The public names are loaded on first use, so ``agentrl.async_rollout.config`` (a run's configuration holds it)
imports no rollout code: the trainer process reads the run configuration and imports none.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.async_rollout.config import EpisodeBudget, RolloutConfig
    from agentrl.async_rollout.curriculum import SkipSolved
    from agentrl.async_rollout.episode import AgentState, EpisodeRunner
    from agentrl.async_rollout.scheduler import RolloutScheduler, RolloutStats
    from agentrl.async_rollout.staleness import StalenessManager

_HOME = {
    "EpisodeBudget": "config", "RolloutConfig": "config", "SkipSolved": "curriculum", "AgentState": "episode",
    "EpisodeRunner": "episode", "RolloutScheduler": "scheduler", "RolloutStats": "scheduler",
    "StalenessManager": "staleness",
}

__all__ = ["AgentState", "EpisodeBudget", "EpisodeRunner", "RolloutConfig", "RolloutScheduler", "RolloutStats",
           "SkipSolved", "StalenessManager"]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)


def __dir__() -> list[str]:
    return __all__
