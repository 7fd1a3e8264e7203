"""The agent gateway's contract: a session's limits, one chat request and its completion (transport-agnostic: the
OpenAI and Anthropic routes translate to and from these), and its errors; its settings are
:mod:`agentrl.gateway.config` (re-exported here).

    AgentRLError
    ├── SessionNotFound (LookupError)  no live session has this id or key (HTTP 404 / 401)
    ├── SessionClosed                  the session was finalized or aborted (HTTP 409)
    └── InfrastructureError
        └── ContinuityError            a commit broke the branch invariant (a bug, never the model's fault)

Engine failures travel as :class:`agentrl.errors.EngineError` (HTTP 503, which the SDKs retry).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from agentrl.engine.base import SamplingParams
from agentrl.errors import AgentRLError, InfrastructureError
from agentrl.gateway.config import GatewayConfig

__all__ = ["CallOut", "ChatCall", "Completion", "ContinuityError", "EpisodeBounds", "FinishReason", "GatewayConfig",
           "SessionClosed", "SessionLimits", "SessionNotFound"]

FinishReason = Literal["stop", "length", "tool_calls"]


class SessionNotFound(AgentRLError, LookupError):
    """No live session has this id (or API key)."""


class SessionClosed(AgentRLError):
    """The session was finalized or aborted: it takes no more requests."""


class ContinuityError(InfrastructureError):
    """A branch's tokens stopped being the engine's prompt ids + sampled ids (a bug in the gateway)."""


class EpisodeBounds(Protocol):
    """What a session takes from a training episode's budget (:class:`agentrl.async_rollout.EpisodeBudget`; the
    gateway sits below the rollout and does not import it)."""

    @property
    def max_turns(self) -> int: ...
    @property
    def max_context_tokens(self) -> int: ...
    @property
    def max_resumes(self) -> int: ...


@dataclass(frozen=True, slots=True)
class SessionLimits:
    """What one session may spend (a training episode's budget; a standalone session has none).

    ``max_turns``: generations; the request after the last one is answered with no text and
    ``finish_reason="length"`` (the session records ``exhausted = "max_turns"``). ``max_context_tokens``: a
    request's ``max_tokens`` is clamped to what remains of it after the prompt; a prompt that leaves no room gets
    the same empty ``length`` answer (``exhausted = "length"``). ``max_new_tokens`` caps every request's
    ``max_tokens``. ``temperature`` / ``top_p``, when set, replace the request's: a trainer scores tokens at the
    temperature they were sampled at, whatever the agent asked for. ``max_resumes``, when set, replaces the
    gateway's (:class:`GatewayConfig`): how often a generation the engine aborted is continued.
    """

    max_turns: int | None = None
    max_context_tokens: int | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_resumes: int | None = None

    @classmethod
    def for_episode(cls, budget: EpisodeBounds, sampling: SamplingParams) -> SessionLimits:
        """The limits of a training episode's session: its budget's turns, context and resumes, its sampling's
        ``max_new_tokens``, ``temperature`` and ``top_p`` (the one place the two become session limits)."""
        return cls(max_turns=budget.max_turns, max_context_tokens=budget.max_context_tokens,
                   max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                   max_resumes=budget.max_resumes)


@dataclass(frozen=True, slots=True)
class ChatCall:
    """One chat request in the gateway's own form: OpenAI-style messages (``content`` a string; an assistant's
    ``tool_calls`` with ``function.arguments`` a dict) and OpenAI function tools."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str = "auto"  # auto | none | required | <function name>
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    regex: str | None = None  # SGLang constrained decoding, passed through (extra_body)
    ebnf: str | None = None
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class CallOut:
    """One tool call of a completion, with the id the client will send back."""

    id: str
    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Completion:
    """What one generation produced, as the routes answer it."""

    content: str  # the text outside tool calls (stop string and end-of-turn token trimmed)
    tool_calls: tuple[CallOut, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    matched_stop: str | None = None  # the stop string that ended it, if any
    ill_formed: bool = False  # the model started a tool call that could not be read (content = its whole text)
    branch: int = 0
