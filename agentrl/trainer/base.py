"""The trainer's contract: what goes in (trajectories, SFT traces) and what comes out (step metrics).

Versions: the trainer's weights carry a version. ``rl_step(batch, current_version=v)`` trains the weights of
version ``v`` and leaves version ``v + 1``, which the caller publishes (``export_hf``). The staleness of a
trajectory is ``v - min(weight_versions of its model tokens)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

from agentrl.types import Trajectory


@runtime_checkable
class TokenTrace(Protocol):
    """Anything SFT can train on: token ids and a loss mask (1 = learn this token) of the same length."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def loss_mask(self) -> Sequence[int]: ...


@dataclass(frozen=True, slots=True)
class Trace:
    """One SFT example (e.g. a ReTool cold-start trace with the prompt and interpreter spans masked)."""

    token_ids: list[int]
    loss_mask: list[int]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.loss_mask):
            raise ValueError(
                f"loss_mask has {len(self.loss_mask)} entries, expected {len(self.token_ids)} (one per token)"
            )


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else x


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """What one RL step did. Means are over the scored (model) tokens of the trained trajectories.

    ``kl`` is None without a reference model. ``is_weight_*`` describe ``exp(logp_prox - logp_behav)``
    (the engine/trainer mismatch plus staleness); ``masked_frac`` the tokens the correction masked out;
    ``behav_kl`` the mean of ``logp_behav - logp_prox``. ``skipped`` is True when the gradient norm was not
    finite and the update was not applied (the version still advances).
    """

    step: int
    weight_version: int
    loss: float
    pg_loss: float
    grad_norm: float
    lr: float
    clip_frac: float
    kl: float | None
    entropy: float
    is_weight_mean: float
    is_weight_min: float
    is_weight_max: float
    masked_frac: float
    behav_kl: float
    staleness_mean: float
    staleness_max: int
    reward_mean: float
    tokens: int
    model_tokens: int
    num_trajectories: int
    dropped_stale: int
    downweighted_stale: int
    dropped_invalid: int
    skipped: bool
    time_s: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (non-finite floats become None)."""
        return {k: _finite(v) if isinstance(v, float) else v for k, v in asdict(self).items()}


@dataclass(frozen=True, slots=True)
class SFTMetrics:
    """What one SFT step did; ``loss`` is the mean next-token NLL over the masked-in tokens."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    model_tokens: int
    num_sequences: int
    skipped: bool
    time_s: float

    def as_dict(self) -> dict[str, Any]:
        return {k: _finite(v) if isinstance(v, float) else v for k, v in asdict(self).items()}


__all__ = ["SFTMetrics", "StepMetrics", "TokenTrace", "Trace", "Trajectory"]
