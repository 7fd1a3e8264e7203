"""The rollout side's settings: the scheduler's (:class:`RolloutConfig`) and each episode's budget
(:class:`EpisodeBudget`). A run's YAML ``rollout:`` section holds them (:mod:`agentrl.launcher.config`); this module
imports no rollout code, so the trainer process can read a run's configuration without it.

The ``Annotated`` bounds are checked where the settings come from outside (pydantic validates them in a run's
configuration); code that builds these dataclasses itself is trusted with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from agentrl.errors import ConfigError

UpdateMode = Literal["drain", "interrupt", "abort_restart"]


@dataclass(frozen=True, slots=True)
class RolloutConfig:
    """The scheduler's settings; its defaults are a run's defaults too (a run's ``rollout:`` composes this class)."""

    n_samples: Annotated[int, Field(ge=1)] = 2  # episodes per task (a GRPO group)
    groups_per_step: Annotated[int, Field(ge=1)] = 4  # groups the trainer consumes per step
    max_staleness: Annotated[int, Field(ge=0)] = 0  # η; 0 = synchronous
    max_running_groups: Annotated[int, Field(ge=1)] = 8
    update_mode: UpdateMode = "interrupt"
    pause_mode: Literal["abort", "retract", "in_place"] = "retract"  # how "interrupt" pauses SGLang
    group_retries: Annotated[int, Field(ge=0)] = 2  # after infrastructure failures
    max_stale_restarts: Annotated[int, Field(ge=0)] = 3  # restarts of a group that would exceed η, then it is dropped
    max_failed_groups: Annotated[int, Field(ge=0)] = 32  # groups dropped after infrastructure failures before the run gives up
    drop_uniform_groups: bool = False  # dynamic sampling: drop groups whose rewards are all equal
    # a budget for it: at most this many groups dropped per group queued (running count); past it a uniform group
    # is queued anyway (no policy-gradient signal, but the trainer does not starve as the policy sharpens)
    max_dropped_per_queued: Annotated[float, Field(ge=0)] | None = None
    # adaptive sampling: a group none of whose episodes solved its task runs up to this many more rounds of
    # n_samples episodes (within the budget above, each round counted as a dropped group); the pool is then cut back
    # to the first round's size, solved and unsolved as even as it allows, advantages against the whole pool
    resample_unsolved: Annotated[int, Field(ge=0)] = 0
    weight_wait_timeout_s: Annotated[float, Field(gt=0)] = 3600.0

    def __post_init__(self) -> None:
        if self.update_mode not in ("drain", "interrupt", "abort_restart"):
            raise ConfigError(f"update_mode must be drain, interrupt or abort_restart, got {self.update_mode!r}")
        if self.n_samples < 1:
            raise ConfigError(f"n_samples must be >= 1, got {self.n_samples}")
        if self.resample_unsolved < 0:
            raise ConfigError(f"resample_unsolved must be >= 0 rounds, got {self.resample_unsolved}")
        if self.max_dropped_per_queued is not None and self.max_dropped_per_queued < 0:
            raise ConfigError(f"max_dropped_per_queued must be >= 0 or None, got {self.max_dropped_per_queued}")


@dataclass(frozen=True, slots=True)
class EpisodeBudget:
    max_turns: Annotated[int, Field(ge=1)] = 8  # model turns
    max_response_tokens: Annotated[int, Field(ge=1)] = 1024  # model + observation tokens after the prompt
    max_context_tokens: Annotated[int, Field(ge=16)] = 4096  # prompt + response
    max_resumes: Annotated[int, Field(ge=0)] = 8  # continuations of aborted requests within one episode
    # trajectories one agent episode may queue (its gateway session's token branches: forks at edited history,
    # sub-agents, compaction); the queue's capacity is sized for it. Past it, the first max_branches - 1 and the
    # one the agent ended on are kept
    max_branches: Annotated[int, Field(ge=1)] = 4
