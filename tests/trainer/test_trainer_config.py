"""Trainer configuration: what is rejected, and the learning-rate schedule."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from agentrl.trainer import LossConfig, OptimizerConfig, TrainerConfig
from agentrl.trainer.model import lr_lambda


@pytest.mark.parametrize(
    ("cls", "kwargs", "words"),
    [
        (OptimizerConfig, {"schedule": "cosine"}, "total_steps"),
        (OptimizerConfig, {"warmup_steps": 10, "total_steps": 5}, "warmup_steps"),
        (OptimizerConfig, {"betas": (0.9, 1.0)}, "betas"),
        (LossConfig, {"icepop_low": 2.0, "icepop_high": 1.5}, "icepop_low"),
        (LossConfig, {"token_sum_norm": 512}, "token_sum_norm"),
        (LossConfig, {"correction": "vtrace"}, "correction"),
        (LossConfig, {"clip_eps_hihg": 0.3}, "clip_eps_hihg"),
        (TrainerConfig, {"model": "m", "dtype": "fp16"}, "dtype"),
    ],
)
def test_invalid_settings_are_rejected_with_the_field_named(cls, kwargs, words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        cls(**kwargs)


def test_yaml_shaped_dict_validates_nested_sections() -> None:
    cfg = TrainerConfig.model_validate(
        {"model": "/m", "optimizer": {"lr": 1e-5}, "loss": {"advantage": "rloo", "max_staleness": 4}}
    )
    assert cfg.optimizer.lr == 1e-5 and cfg.loss.advantage == "rloo" and cfg.loss.max_staleness == 4
    assert cfg.loss.correction == "decoupled" and cfg.layout == "packed"


def test_lr_schedule_warmup_then_cosine_to_floor() -> None:
    f = lr_lambda(warmup=4, schedule="cosine", total=14, min_ratio=0.1)
    assert [f(u) for u in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    const = lr_lambda(warmup=0, schedule="constant", total=None, min_ratio=0.0)
    assert const(0) == const(1000) == 1.0
