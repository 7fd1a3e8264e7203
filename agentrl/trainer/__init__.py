"""Off-policy-tolerant FSDP2 trainer: GRPO/PPO family with decoupled, TIS and IcePop corrections, staleness
control, SFT, atomic checkpoints and HF weight export. Imports no SGLang and no rollout code.

The public names are loaded on first use, so ``agentrl.trainer.config`` (pydantic only; a run's configuration
holds it) can be imported without torch: the rollout process reads the run configuration and imports no torch
training code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentrl._lazy import lazy_exports

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
    from agentrl.trainer.config import LoraConfig, LossConfig, OptimizerConfig, TrainerConfig, TrainerSettings
    from agentrl.trainer.engine import Trainer, broadcast_object, process_group
    from agentrl.trainer.storage import latest_checkpoint

_HOME = {
    **dict.fromkeys(["SFTMetrics", "StepMetrics", "TokenTrace", "Trace"], "base"),
    **dict.fromkeys(["MicroBatch", "PreparedBatch", "SeqSample", "plan_micro_batches", "prepare_rl", "prepare_sft"],
                    "collate"),
    **dict.fromkeys(["LoraConfig", "LossConfig", "OptimizerConfig", "TrainerConfig", "TrainerSettings"], "config"),
    **dict.fromkeys(["Trainer", "broadcast_object", "process_group"], "engine"),
    **dict.fromkeys(["latest_checkpoint"], "storage"),
}

__all__ = [
    "LoraConfig",
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
    "process_group",
]

__getattr__, __dir__ = lazy_exports(__name__, _HOME)
