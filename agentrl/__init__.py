"""agentrl: asynchronous, agentic, multi-turn RL for LLMs with tool sandboxes.

Public Python API: ``tool`` (decorator), ``register_env`` / ``Environment``, ``list_tools()``, ``list_envs()``;
plugins register through the entry-point group ``agentrl.plugins``.
"""

from agentrl.env import Environment, Observation, StepResult, list_envs, list_tools, register_env, tool
from agentrl.errors import AgentRLError, ConfigError, InfrastructureError
from agentrl.rewards import RewardInput, RewardResult
from agentrl.types import FinishReason, Task, Trajectory

__version__ = "0.1.0"

__all__ = [
    "tool", "register_env", "Environment", "Observation", "StepResult", "RewardInput", "RewardResult", "list_tools", "list_envs",
    "AgentRLError", "ConfigError", "InfrastructureError", "Task", "Trajectory", "FinishReason",
]
