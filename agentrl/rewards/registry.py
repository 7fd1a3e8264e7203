"""The reward registry: a plain ``dict[str, RewardFactory]`` by name, and weighted composition by name.

Built-in names: ``math`` (:class:`MathReward`; options ``verifier=`` or MathVerifier options), ``code_tests``
(:class:`CodeTestsReward`; needs ``sandbox=``), ``format``, ``tool_call_penalty``, ``length_penalty`` (needs
``max_tokens=``). Plugins add theirs with :func:`register_reward`.

Resources (a :class:`MathVerifier`, a sandbox) are created by the caller and passed in as options, so one
pool or sandbox serves every reward of a process.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentrl.errors import ConfigError
from agentrl.rewards.base import RewardFactory, RewardFn
from agentrl.rewards.code import CodeTestsReward
from agentrl.rewards.math import MathReward
from agentrl.rewards.shaping import FormatReward, LengthPenalty, ToolCallPenalty, WeightedReward


def builtin_rewards() -> dict[str, RewardFactory]:
    """A fresh registry holding only the built-in rewards."""
    return {
        "math": MathReward,
        "code_tests": CodeTestsReward,
        "format": FormatReward,
        "tool_call_penalty": ToolCallPenalty,
        "length_penalty": LengthPenalty,
    }


REWARDS: dict[str, RewardFactory] = builtin_rewards()
"""The process's registry (plugins register here); pass ``registry=`` to the functions below for another."""


def register_reward(
    name: str,
    factory: RewardFactory,
    *,
    registry: dict[str, RewardFactory] | None = None,
    replace: bool = False,
) -> None:
    """Register ``factory(**options) -> RewardFn`` under ``name``."""
    target = REWARDS if registry is None else registry
    if name in target and not replace and target[name] is not factory:
        raise ConfigError(f"a reward named {name!r} is already registered; pass replace=True to override it")
    target[name] = factory


def get_reward(name: str, *, registry: Mapping[str, RewardFactory] | None = None, **options: Any) -> RewardFn:
    """Build the reward registered as ``name`` with ``options``."""
    source = REWARDS if registry is None else registry
    if name not in source:
        raise ConfigError(f"unknown reward {name!r}; registered rewards: {sorted(source)}")
    try:
        return source[name](**options)
    except TypeError as exc:
        raise ConfigError(f"bad options for reward {name!r}: {exc}") from exc


def combine(
    weights: Mapping[str, float],
    *,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    rewards: Mapping[str, RewardFn] | None = None,
    registry: Mapping[str, RewardFactory] | None = None,
) -> WeightedReward:
    """``sum(weight * reward)`` over ``{name: weight}``.

    Each name is taken from ``rewards`` (ready-made functions) if there, else built from the registry with
    ``options[name]``. Example: ``combine({"math": 1.0, "format": 0.1}, options={"math": {"verifier": v}})``.
    """
    options, rewards = options or {}, rewards or {}
    unknown = set(options) - set(weights)
    if unknown:
        raise ConfigError(
            f"options given for {sorted(unknown)}, which are not in the weights {sorted(weights)}"
        )
    components = {
        name: (
            rewards[name]
            if name in rewards
            else get_reward(name, registry=registry, **options.get(name, {})),
            float(weight),
        )
        for name, weight in weights.items()
    }
    return WeightedReward(components)
