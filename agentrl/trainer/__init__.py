"""Off-policy-tolerant FSDP2 trainer: GRPO/PPO family with decoupled, TIS and IcePop corrections, staleness
control, SFT, atomic checkpoints and HF weight export. Imports no SGLang and no rollout code."""

from agentrl.trainer.base import SFTMetrics, StepMetrics, TokenTrace, Trace
from agentrl.trainer.collate import (
    MicroBatch,
    PreparedBatch,
    SeqSample,
    plan_micro_batches,
    prepare_rl,
    prepare_sft,
)
from agentrl.trainer.config import LossConfig, OptimizerConfig, TrainerConfig
from agentrl.trainer.engine import Trainer, broadcast_object
from agentrl.trainer.storage import latest_checkpoint

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
    "broadcast_object",
    "latest_checkpoint",
    "plan_micro_batches",
    "prepare_rl",
    "prepare_sft",
]
