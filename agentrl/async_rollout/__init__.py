"""Async multi-turn rollout: episodes (token-in/token-out; text-level ones through a chat-completions engine, for
evaluation) and the staleness-bounded scheduler.

The public names are loaded on first use, so ``agentrl.async_rollout.config`` (a run's configuration holds it)
imports no rollout code: the trainer process reads the run configuration and imports none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentrl._lazy import lazy_exports

if TYPE_CHECKING:
    from agentrl.async_rollout.chat_episode import ChatEpisode, ChatEpisodeRunner
    from agentrl.async_rollout.config import EpisodeBudget, RolloutConfig
    from agentrl.async_rollout.curriculum import SkipSolved
    from agentrl.async_rollout.episode import AgentState, EpisodeRunner
    from agentrl.async_rollout.scheduler import RolloutScheduler, RolloutStats
    from agentrl.async_rollout.staleness import StalenessManager

_HOME = {
    **dict.fromkeys(["ChatEpisode", "ChatEpisodeRunner"], "chat_episode"),
    **dict.fromkeys(["EpisodeBudget", "RolloutConfig"], "config"),
    **dict.fromkeys(["SkipSolved"], "curriculum"),
    **dict.fromkeys(["AgentState", "EpisodeRunner"], "episode"),
    **dict.fromkeys(["RolloutScheduler", "RolloutStats"], "scheduler"),
    **dict.fromkeys(["StalenessManager"], "staleness"),
}

__all__ = ["AgentState", "ChatEpisode", "ChatEpisodeRunner", "EpisodeBudget", "EpisodeRunner", "RolloutConfig", "RolloutScheduler", "RolloutStats",
           "SkipSolved", "StalenessManager"]

__getattr__, __dir__ = lazy_exports(__name__, _HOME)
