"""The reward side's settings (:class:`RewardsConfig`): a run's ``rewards:`` section and the evaluation service's.
A module of its own, pydantic only, so the trainer process reads a run's configuration without the rewards."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from agentrl.rewards.verifier import MathVerifier


class RewardsConfig(BaseModel):
    """What the rewards of one process share: the math checker pool (:class:`~agentrl.rewards.MathVerifier`)."""

    model_config = ConfigDict(extra="forbid")

    verifier_workers: Annotated[int, Field(ge=1)] = 1  # math checker processes (each check bounded in time)

    def math_verifier(self) -> MathVerifier:
        """The process's math checker pool; its workers start on ``start()`` or the first check."""
        from agentrl.rewards.verifier import MathVerifier

        return MathVerifier(workers=self.verifier_workers)
