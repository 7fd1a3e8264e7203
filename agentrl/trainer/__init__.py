"""Off-policy-tolerant FSDP2 trainer: GRPO/PPO family with decoupled, TIS and IcePop corrections, staleness
control, SFT, atomic checkpoints and HF weight export. Imports no SGLang and no rollout code.

The public names are loaded on first use, so ``agentrl.trainer.config`` (pydantic only; a run's configuration
holds it) can be imported without torch: the rollout process reads the run configuration and imports no torch
training code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.trainer.base import SFTMetrics, StepMetrics, TokenTrace, Trace
    from agentrl.trainer.collate import (
        MicroBatch,
        PreparedBatch,
        SeqSample,
        plan_micro_batches,
        prepare_rl,
        prepare_sft,
    )
    from agentrl.trainer.config import LossConfig, OptimizerConfig, TrainerConfig, TrainerSettings
    from agentrl.trainer.engine import Trainer, broadcast_object
    from agentrl.trainer.storage import latest_checkpoint

_HOME = {
    "SFTMetrics": "base", "StepMetrics": "base", "TokenTrace": "base", "Trace": "base",
    "MicroBatch": "collate", "PreparedBatch": "collate", "SeqSample": "collate", "plan_micro_batches": "collate",
    "prepare_rl": "collate", "prepare_sft": "collate",
    "LossConfig": "config", "OptimizerConfig": "config", "TrainerConfig": "config", "TrainerSettings": "config",
    "Trainer": "engine", "broadcast_object": "engine",
    "latest_checkpoint": "storage",
}

__all__ = [
    "LossConfig",
    "MicroBatch",
    "OptimizerConfig",
    "PreparedBatch",
    "SFTMetrics",
    "SeqSample",
    "StepMetrics",
    "TokenTrace",
    "Trace",
    "Trainer",
    "TrainerConfig",
    "TrainerSettings",
    "broadcast_object",
    "latest_checkpoint",
    "plan_micro_batches",
    "prepare_rl",
    "prepare_sft",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)


def __dir__() -> list[str]:
    return __all__
