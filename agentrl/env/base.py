"""The environment contract: a small async, gym-like surface an episode runner drives.

An episode: ``messages = await env.reset(task)`` (built with :func:`prompt_messages`); then, for each model turn,
``result = await env.step(text)`` with the text the model generated in that turn; the episode ends when
``result.done``; finally ``await env.score(response)`` (a :class:`agentrl.rewards.RewardInput`: the model's own text,
tool observations left out, plus tool-call counts) gives the reward and ``await env.close()`` frees per-episode
resources (a sandbox session, say). One environment instance serves one episode.

Observations come back either as raw text appended right after the model's tokens (ReTool's
``<interpreter>…</interpreter>`` inside the same assistant message) or as chat messages (a ``tool`` role turn)
that the runner renders with the chat template. The runner never re-tokenises earlier turns.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from agentrl.rewards.base import RewardInput, RewardResult
from agentrl.types import Task, ToolCall, ToolResult


@dataclass(frozen=True, slots=True)
class Observation:
    """What the environment answers a tool call with: ``text`` appended verbatim, or chat ``messages``."""

    text: str | None = None
    messages: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class StepResult:
    """The outcome of one model turn. ``observation`` is None when the turn called no tool."""

    observation: Observation | None
    done: bool
    tool_calls: tuple[ToolCall, ...] = ()
    tool_results: tuple[ToolResult, ...] = ()


def prompt_messages(task: Task, system_prompt: str | None = None) -> list[dict[str, Any]]:
    """The conversation an episode starts from. A task with chat messages (``Task.messages``) starts from them,
    with ``system_prompt`` put first only when they hold no system message of their own; a plain task starts from
    the system prompt (if any) and its prompt as the user message. Every environment's ``reset`` builds its
    messages here, so a messages prompt can never be mistaken for text."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    if task.messages:
        own = [dict(m) for m in task.messages]
        return own if any(m.get("role") == "system" for m in own) else [*system, *own]
    return [*system, {"role": "user", "content": task.prompt}]


class Environment(abc.ABC):
    """Base class of environments. Subclasses set ``name`` and ``stop`` and implement the three methods."""

    name: ClassVar[str] = ""
    #: strings that end a model turn so a tool can answer (e.g. ``("</code>",)``); EOS always ends an episode
    stop: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    async def reset(self, task: Task) -> list[dict[str, Any]]:
        """Start an episode; return the prompt as chat messages."""

    @abc.abstractmethod
    async def step(self, text: str) -> StepResult:
        """React to one model turn (its decoded text)."""

    @abc.abstractmethod
    async def score(self, response: RewardInput) -> RewardResult:
        """Reward of the episode. An ``INFRA_ERROR`` result means: do not train on this sample (it is not 0)."""

    def tool_schemas(self) -> list[dict[str, Any]]:
        """Function schemas rendered into the prompt (chat-template ``tools``); none by default."""
        return []

    async def close(self) -> None:
        """Free per-episode resources. Always called, also after errors."""

    async def __aenter__(self) -> Environment:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class SingleTurnEnv(Environment):
    """One model turn, scored by ``self.reward`` against the task: subclasses set ``system_prompt`` and
    ``reward`` and check in :meth:`validate` that a task carries what their reward needs."""

    system_prompt: str
    reward: Any  # an async callable (task, RewardInput) -> RewardResult
    task: Task | None = None

    def validate(self, task: Task) -> None:
        """Raise ConfigError when ``task`` lacks what this environment's reward needs."""

    async def reset(self, task: Task) -> list[dict[str, Any]]:
        self.validate(task)
        self.task = task
        return prompt_messages(task, self.system_prompt)

    async def step(self, text: str) -> StepResult:
        return StepResult(None, True)

    async def score(self, response: RewardInput) -> RewardResult:
        if self.task is None:
            raise RuntimeError("score() called before reset()")
        return await self.reward(self.task, response)  # type: ignore[no-any-return]
