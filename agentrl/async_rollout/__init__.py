"""Async multi-turn rollout: episodes (token-in/token-out) and the staleness-bounded scheduler."""

from agentrl.async_rollout.curriculum import SkipSolved
from agentrl.async_rollout.episode import AgentState, EpisodeBudget, EpisodeRunner
from agentrl.async_rollout.scheduler import RolloutConfig, RolloutScheduler, RolloutStats
from agentrl.async_rollout.staleness import StalenessManager

__all__ = ["AgentState", "EpisodeBudget", "EpisodeRunner", "RolloutConfig", "RolloutScheduler", "RolloutStats",
           "SkipSolved", "StalenessManager"]
