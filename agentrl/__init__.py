"""agentrl: asynchronous, agentic, multi-turn RL for LLMs with tool sandboxes.

Public Python API: ``tool`` (decorator), ``register_env`` / ``Environment``, ``agent`` (decorator: a user's agent
function as an environment; ``ClientConfig`` is what it is called with), ``list_tools()``, ``list_envs()``;
plugins register through the entry-point group ``agentrl.plugins``. The names are loaded on first use, so importing
one module of agentrl (e.g. the trainer process's) does not import every environment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentrl._lazy import lazy_exports

if TYPE_CHECKING:
    from agentrl.env import Environment, Observation, StepResult, list_envs, list_tools, register_env, tool
    from agentrl.env.agent import AgentOutcome, ClientConfig, agent
    from agentrl.errors import AgentRLError, ConfigError, InfrastructureError
    from agentrl.rewards import RewardInput, RewardResult
    from agentrl.types import FinishReason, Task, Trajectory

__version__ = "0.1.0"

_HOME = {
    **dict.fromkeys(["Environment", "Observation", "StepResult", "list_envs", "list_tools", "register_env", "tool"],
                    "env"),
    **dict.fromkeys(["AgentOutcome", "ClientConfig", "agent"], "env.agent"),
    **dict.fromkeys(["AgentRLError", "ConfigError", "InfrastructureError"], "errors"),
    **dict.fromkeys(["RewardInput", "RewardResult"], "rewards"),
    **dict.fromkeys(["FinishReason", "Task", "Trajectory"], "types"),
}

__all__ = [
    "tool", "register_env", "agent", "ClientConfig", "AgentOutcome", "Environment", "Observation", "StepResult", "RewardInput", "RewardResult", "list_tools", "list_envs",
    "AgentRLError", "ConfigError", "InfrastructureError", "Task", "Trajectory", "FinishReason",
]

__getattr__, __dir__ = lazy_exports(__name__, _HOME)
