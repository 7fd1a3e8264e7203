"""Experiment trackers beside TensorBoard: Weights & Biases and trackio, each optional (``pip install
'agentrl[wandb]'``), fed from the same per-step records as TensorBoard (``metrics.jsonl`` lines) and the run's
summary at the end.

Both are configured under ``monitor`` (``monitor.wandb``, ``monitor.trackio``; null = off). W&B's ``mode:
offline`` writes the run under ``runs/<name>/wandb/`` for a later ``wandb sync``; trackio logs to its local
database (``TRACKIO_DIR``) unless a ``space_id`` is given. A tracker that fails to start stops the run before
anything else starts only if it cannot be imported; once running, a failing ``log`` is reported once and the run
goes on (metrics are also in ``metrics.jsonl``).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from agentrl.errors import ConfigError

logger = logging.getLogger(__name__)


class WandbSection(BaseModel):
    """``monitor.wandb``: a Weights & Biases run per training run."""

    model_config = ConfigDict(extra="forbid")

    project: str = "agentrl"
    entity: str | None = None
    mode: Literal["online", "offline", "disabled"] = "offline"  # offline: no network; `wandb sync` later
    tags: list[str] = Field(default_factory=list)
    group: str | None = None


class TrackioSection(BaseModel):
    """``monitor.trackio``: a trackio run per training run (local database unless ``space_id``)."""

    model_config = ConfigDict(extra="forbid")

    project: str = "agentrl"
    space_id: str | None = None  # a Hugging Face Space to sync to (needs network); None: local only


class Tracker(Protocol):
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def summary(self, values: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"monitor.{module} is set but {module} is not installed: pip install 'agentrl[wandb]' "
                          f"(or pip install {module}), or set monitor.{module}: null") from exc


class WandbTracker:
    def __init__(self, cfg: WandbSection, *, name: str, run_dir: Path, config: Mapping[str, Any]) -> None:
        wandb = _import("wandb")
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=cfg.project, entity=cfg.entity, name=name, id=name, resume="allow",
                               mode=cfg.mode, tags=cfg.tags or None, group=cfg.group, dir=str(run_dir),
                               config=dict(config), settings=wandb.Settings(silent=True, console="off"))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._run.log(dict(metrics), step=step)

    def summary(self, values: Mapping[str, Any]) -> None:
        self._run.summary.update(dict(values))

    def close(self) -> None:
        self._run.finish()


class TrackioTracker:
    def __init__(self, cfg: TrackioSection, *, name: str, run_dir: Path, config: Mapping[str, Any]) -> None:
        self._trackio = _import("trackio")
        self._run = self._trackio.init(project=cfg.project, name=name, space_id=cfg.space_id, config=dict(config),
                                       resume="allow", embed=False, auto_log_cpu=False, auto_log_gpu=False)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._run.log(dict(metrics), step=step)

    def summary(self, values: Mapping[str, Any]) -> None:
        numbers = {f"summary/{k}": v for k, v in values.items() if isinstance(v, (int, float))
                   and not isinstance(v, bool)}
        if numbers:
            self._run.log(numbers)

    def close(self) -> None:
        self._run.finish()


def make_trackers(wandb: WandbSection | None, trackio: TrackioSection | None, *, name: str, run_dir: Path,
                  config: Mapping[str, Any]) -> list[Tracker]:
    out: list[Tracker] = []
    if wandb is not None:
        out.append(WandbTracker(wandb, name=name, run_dir=run_dir, config=config))
    if trackio is not None:
        out.append(TrackioTracker(trackio, name=name, run_dir=run_dir, config=config))
    return out


def check_trackers(wandb: WandbSection | None, trackio: TrackioSection | None) -> None:
    """Before anything starts: the configured trackers can be imported."""
    for module, section in (("wandb", wandb), ("trackio", trackio)):
        if section is not None:
            _import(module)
