"""Shaping rewards (format, tool-call hygiene, length) and the weighted sum that composes rewards.

Each is a small reward function over :class:`~agentrl.rewards.base.RewardInput`; none needs a sandbox, so they
are cheap and always OK. Scales (so that weights mean what they say):

- :class:`FormatReward` in [0, 1]: the mean of "a final answer is present" and "the tool calls were
  well formed" (``1 - malformed / calls``; 1 with no calls);
- :class:`ToolCallPenalty` in [-cap, 0]: ``-min(cap, per_call * malformed)``;
- :class:`LengthPenalty` in [-1, 0]: DAPO's soft overlong punishment with ``L = max_tokens``, ``C = buffer``:
  0 if ``n <= L - C``; ``(L - C - n) / C`` if ``L - C < n <= L``; -1 beyond ``L`` or when the episode was cut
  off by the token budget (``finish_reason == LENGTH``).

:class:`WeightedReward` runs its components concurrently and returns ``sum(w_i * s_i)``; if any component is
INFRA_ERROR the sum is INFRA_ERROR too (no score: a partial sum would look like a real reward).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Self

from agentrl.errors import ConfigError
from agentrl.rewards._normalize import extract_answer
from agentrl.rewards.base import RewardFn, RewardInput, RewardResult
from agentrl.types import FinishReason, Task


class FormatReward:
    """1.0 for a present final answer and well-formed tool calls; see the module docstring."""

    def __init__(self, *, require_answer: bool = True, check_tool_calls: bool = True) -> None:
        if not (require_answer or check_tool_calls):
            raise ConfigError("FormatReward needs require_answer or check_tool_calls (or both)")
        self._require_answer = require_answer
        self._check_tool_calls = check_tool_calls

    async def __call__(self, task: Task, response: RewardInput, /) -> RewardResult:
        parts: dict[str, float] = {}
        if self._require_answer:
            parts["answer_present"] = 0.0 if extract_answer(response.text) is None else 1.0
        if self._check_tool_calls:
            calls, bad = response.num_tool_calls, response.num_malformed_tool_calls
            parts["tool_calls_well_formed"] = 1.0 if calls == 0 else max(0.0, 1.0 - bad / calls)
        return RewardResult.scored(sum(parts.values()) / len(parts), **parts)


class ToolCallPenalty:
    """``-min(cap, per_call * malformed_calls)``."""

    def __init__(self, *, per_call: float = 0.1, cap: float = 1.0) -> None:
        if per_call < 0 or cap < 0:
            raise ConfigError(f"ToolCallPenalty needs per_call >= 0 and cap >= 0, got {per_call}, {cap}")
        self._per_call = per_call
        self._cap = cap

    async def __call__(self, task: Task, response: RewardInput, /) -> RewardResult:
        bad = response.num_malformed_tool_calls
        return RewardResult.scored(-min(self._cap, self._per_call * bad), malformed_tool_calls=bad)


class LengthPenalty:
    """DAPO soft overlong punishment; see the module docstring for the formula."""

    def __init__(self, *, max_tokens: int, buffer: int | None = None) -> None:
        buffer = max_tokens // 4 if buffer is None else buffer
        if max_tokens <= 0 or not 0 < buffer <= max_tokens:
            raise ConfigError(
                f"LengthPenalty needs max_tokens > 0 and 0 < buffer <= max_tokens, got {max_tokens}, {buffer}"
            )
        self._max = max_tokens
        self._buffer = buffer

    async def __call__(self, task: Task, response: RewardInput, /) -> RewardResult:
        n, soft = response.response_tokens, self._max - self._buffer
        if response.finish_reason is FinishReason.LENGTH or n > self._max:
            score = -1.0
        elif n > soft:
            score = (soft - n) / self._buffer
        else:
            score = 0.0
        return RewardResult.scored(score, response_tokens=n)


class WeightedReward:
    """``sum(weight * score)`` over named components, run concurrently.

    ``details``: ``breakdown`` (name → unweighted score, for ``Trajectory.reward_breakdown``) and
    ``components`` (name → that component's details). ``aclose`` closes components that have ``aclose``.
    """

    def __init__(self, components: Mapping[str, tuple[RewardFn, float]]) -> None:
        if not components:
            raise ConfigError("WeightedReward needs at least one component")
        self._components = dict(components)

    async def __call__(self, task: Task, response: RewardInput, /) -> RewardResult:
        async with asyncio.TaskGroup() as group:
            tasks = {
                name: group.create_task(_as_coroutine(fn, task, response))
                for name, (fn, _) in self._components.items()
            }
        results = {name: t.result() for name, t in tasks.items()}
        details = {name: dict(r.details) for name, r in results.items()}
        breakdown = {name: r.score for name, r in results.items()}
        failed = [name for name, r in results.items() if not r.ok]
        if failed:
            return RewardResult.infra_error(
                f"reward component(s) {failed} could not be computed", breakdown=breakdown, components=details
            )
        total = sum(weight * results[name].score for name, (_, weight) in self._components.items())
        return RewardResult.scored(total, breakdown=breakdown, components=details)

    async def aclose(self) -> None:
        for fn, _ in self._components.values():
            close = getattr(fn, "aclose", None)
            if close is not None:
                await close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _as_coroutine(fn: RewardFn, task: Task, response: RewardInput) -> RewardResult:
    return await fn(task, response)
