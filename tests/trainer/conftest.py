"""Trainer test fixtures: torch threads kept low (the machine is shared), configs on the tiny model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.trainer import TrainerConfig


@pytest.fixture(autouse=True, scope="session")
def _torch_threads() -> None:
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_path: Path):
    """The tiny model in plain HF transformers (fp32, eval mode): the reference the trainer's numbers are checked
    against."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()


@pytest.fixture
def tiny_config(tiny_model_path: Path) -> Callable[..., TrainerConfig]:
    """``tiny_config(lr=..., loss={...}, **trainer_fields)`` builds a TrainerConfig on the tiny model."""

    def make(*, lr: float = 1e-3, loss: dict[str, Any] | None = None, **kw: Any) -> TrainerConfig:
        opt = kw.pop("optimizer", {})
        return TrainerConfig.model_validate(
            {"model": str(tiny_model_path), "dtype": "fp32", "optimizer": {"lr": lr, **opt}, "loss": loss or {}, **kw}
        )

    return make
