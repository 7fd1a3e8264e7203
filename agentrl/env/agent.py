"""The ``agent`` environment kind: the episode is a user's own agent, an async function that talks to the model
through an OpenAI- (or Anthropic-) compatible endpoint, any client or framework.

    @agentrl.agent("calculator", reward="math")
    async def run(task: agentrl.Task, client: agentrl.ClientConfig) -> str:
        llm = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key)
        ...                                    # the agent's loop, its tools
        return final_answer                    # scored by the environment's reward

In a training run each call gets its own gateway session (``client.base_url``); the rollout's agent runner
(:mod:`agentrl.async_rollout.agent_episode`) turns the session's token branches into trajectories. The reward is
the environment's ``reward`` applied to the result (as text) and/or the reward the agent posted to
``client.reward_url`` (``{"reward": 1.0}``); with both, their sum.

Errors: what the agent raises is the episode's outcome (the model's mistakes break agents too: the sample is
scored, its error recorded), except agentrl's own errors, which propagate. :class:`AgentError`
(infrastructure: the group is retried, then dropped) when the agent made no request at all or did not return
within ``timeout_s``: neither can be the model's doing, and a hang must never look like a wrong answer.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from agentrl.env.registry import EnvResources, default_registry
from agentrl.env.tool_parsers import BUILTIN
from agentrl.errors import ConfigError, InfrastructureError
from agentrl.rewards.base import RewardFn, RewardInput, RewardResult
from agentrl.types import FinishReason, Task

AgentFn = Callable[[Task, "ClientConfig"], Awaitable[Any]]

#: ``reward=`` names: "math" checks the result's final \boxed{} (or <answer>) against Task.answer; "posted" uses
#: only what the agent posted
REWARDS = ("math", "posted")


class AgentError(InfrastructureError):
    """The agent function failed in a way that is not the model's: it made no chat request, or it did not
    return within its time limit."""


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Where an agent sends its chat requests during one episode: one gateway session.

    ``openai.AsyncOpenAI(base_url=c.base_url, api_key=c.api_key)``; Anthropic clients take
    ``anthropic_base_url``; agents that can only set a key may use the bare ``/v1`` routes with ``api_key``.

    ``http_client``, when set (the gateway runs in the agent's process, as in training and evaluation), is an
    ``httpx.AsyncClient`` that reaches the same routes without a socket: pass it to the SDK
    (``openai.AsyncOpenAI(..., http_client=c.http_client)``, LangChain's ``ChatOpenAI(http_async_client=...)``;
    the anthropic SDK takes its own httpx fork: ``anthropic.AsyncAnthropic(..., http_client=
    c.anthropic_http_client)``) to save about 1 ms of CPU per request and the SDK's own
    client (whose SSL context alone costs ~20 ms to build). The SDK's timeouts do not apply through it; the
    episode's ``timeout_s`` and the gateway's engine timeouts do. Do not close it: the gateway owns it."""

    base_url: str
    api_key: str
    model: str
    anthropic_base_url: str = ""
    reward_url: str = ""  # POST {"reward": float, "finished": bool?, "metrics": {...}?} here
    session_id: str = ""
    http_client: httpx.AsyncClient | None = field(default=None, repr=False, compare=False)
    anthropic_http_client: Any = field(default=None, repr=False, compare=False)  # an httpx2.AsyncClient


@dataclass(frozen=True, slots=True)
class AgentOutcome:
    """How one agent episode ended, as its reward sees it."""

    result: Any  # what the agent returned (None when it raised)
    text: str  # the result as text; without one, the model's last turn
    posted: float | None = None  # what the agent posted to reward_url
    metrics: dict[str, float] = field(default_factory=dict)
    finish_reason: FinishReason = FinishReason.STOP
    error: str | None = None  # what the agent raised


class AgentEnv:
    """An agent environment: ``run`` is the episode, ``score`` its reward (see the module docstring)."""

    kind = "agent"

    def __init__(self, run: AgentFn, *, reward: RewardFn | None = None, timeout_s: float = 600.0,
                 name: str = "", tool_parser: str = BUILTIN) -> None:
        if timeout_s <= 0:
            raise ConfigError(f"an agent's timeout_s must be > 0, got {timeout_s}")
        self.run, self.reward, self.timeout_s, self.name = run, reward, timeout_s, name
        self.tool_parser = tool_parser  # how the gateway reads the model's tool calls (agentrl.env.tool_parsers)

    async def score(self, task: Task, outcome: AgentOutcome) -> RewardResult:
        """The rule reward on the result, plus the posted one (either alone when only one is there; 0 with
        neither). An ``INFRA_ERROR`` from the rule reward comes back as is."""
        parts: dict[str, float] = {}
        if self.reward is not None:
            ruled = await self.reward(task, RewardInput(text=outcome.text, finish_reason=outcome.finish_reason))
            if not ruled.ok:
                return ruled
            parts.update(ruled.details.get("breakdown") or {"correct": ruled.score})
            total = ruled.score
        else:
            total = 0.0
        if outcome.posted is not None and math.isfinite(outcome.posted):
            parts["posted"] = outcome.posted
            total += outcome.posted
        return RewardResult.scored(total, breakdown=parts or {"reward": total})

    async def close(self) -> None:
        """Nothing to free: the agent owns its clients."""

    async def __aenter__(self) -> AgentEnv:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _check_reward(reward: RewardFn | str | None) -> None:
    if isinstance(reward, str) and reward not in REWARDS or not (reward is None or isinstance(reward, str)
                                                                 or callable(reward)):
        raise ConfigError(f"an agent's reward must be one of {', '.join(REWARDS)} or an async "
                          f"(task, RewardInput) -> RewardResult function, got {reward!r}")


def _reward(reward: RewardFn | str | None, resources: EnvResources) -> RewardFn | None:
    _check_reward(reward)
    if reward is None or reward == "posted":
        return None
    if reward == "math":
        from agentrl.rewards import MathReward

        if resources.verifier is None:
            raise ConfigError("reward='math' needs the process's math checker pool (EnvResources.verifier)")
        return MathReward(resources.verifier)
    assert not isinstance(reward, str)
    return reward


def agent_factory(run: AgentFn, *, reward: RewardFn | str | None = None,
                  timeout_s: float = 600.0) -> Callable[..., AgentEnv]:
    """A registry factory (``factory(resources, **options)``) for the agent ``run``; a run's ``env.options`` may
    set ``reward`` (by name), ``timeout_s`` and ``tool_parser`` (the gateway's: ``builtin`` or an SGLang parser
    name such as ``qwen25``)."""

    @functools.wraps(run)  # the registry tells definitions apart by the agent function's origin
    def factory(resources: EnvResources, *, reward: RewardFn | str | None = reward, timeout_s: float = timeout_s,
                tool_parser: str = BUILTIN) -> AgentEnv:
        return AgentEnv(run, reward=_reward(reward, resources), timeout_s=float(timeout_s),
                        name=getattr(run, "__name__", ""), tool_parser=tool_parser)

    _check_reward(reward)  # a bad reward fails at registration, not in the first episode
    factory.__signature__ = inspect.signature(factory, follow_wrapped=False)  # type: ignore[attr-defined]  # options
    factory.agentrl_kind = "agent"  # type: ignore[attr-defined]
    return factory


def agent(name: str | AgentFn | None = None, *, reward: RewardFn | str | None = None, timeout_s: float = 600.0,
          description: str = "", replace: bool = False) -> Any:
    """Register an agent function as an environment (``@agentrl.agent`` or ``@agentrl.agent("name", ...)``);
    the name defaults to the function's. See the module docstring."""

    def deco(run: AgentFn) -> AgentFn:
        default_registry.register_env(name if isinstance(name, str) else run.__name__,
                                      agent_factory(run, reward=reward, timeout_s=timeout_s),
                                      description=description, replace=replace)
        return run

    return deco(name) if callable(name) else deco

