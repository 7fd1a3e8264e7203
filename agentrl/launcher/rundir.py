"""The run directory policy: a directory that holds a run is never reused silently.

``runs/<name>/`` holds a run once its ``config.yaml`` is written. Starting a run there again is refused unless
the user says what they mean:

- ``--resume``: continue from the last checkpoint (``checkpoints/step-N``): the trainer restores step N and
  version v, the embedded Redis (its AOF in ``redis/``) still holds the queue, versions published after v are
  forgotten (their steps are trained again), and the rollout side produces only the groups still missing;
- ``--overwrite``: delete the directory and start clean.

A resumed run must be the same run: its model and LoRA settings are compared with the ``config.yaml`` the run wrote
(:func:`check_same_run`) before anything starts, since its checkpoint and ``weights/v0`` hold what those made (a
resume of `agentrl demo --lora` without ``--lora`` would otherwise go on as full fine-tuning, silently while
there is no checkpoint yet). Other settings (``steps``, rates, resources, …) may change on resume.

While a run uses its directory, the driver holds an exclusive lock on ``.agentrl.lock``: a second driver
(resume, overwrite or a plain start) is refused with the pid of the one running.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from agentrl.errors import ConfigError

if TYPE_CHECKING:
    from agentrl.launcher.config import RunConfig

logger = logging.getLogger(__name__)

LOCK_FILE = ".agentrl.lock"


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a resumed run continues: after trainer ``step`` at weight ``version`` (0, 0: no checkpoint yet);
    ``entry_ids``: queue entries the checkpoint trained on (acknowledged again, idempotently, before anything
    reads the queue)."""

    step: int = 0
    version: int = 0
    entry_ids: tuple[str, ...] = ()


def holds_run(run_dir: Path) -> bool:
    return (run_dir / "config.yaml").is_file()


def resume_point(run_dir: Path) -> ResumePoint:
    """The step, version and entry ids of the checkpoint the resumed trainer will load (the trainer's own choice:
    its newest complete checkpoint)."""
    from agentrl.trainer.storage import STATE_FILE, latest_checkpoint

    newest = latest_checkpoint(run_dir / "checkpoints")
    if newest is None:
        return ResumePoint()
    doc = json.loads((newest / STATE_FILE).read_text())
    return ResumePoint(step=int(doc["step"]), version=int(doc["weight_version"]),
                       entry_ids=tuple(doc.get("extra", {}).get("entry_ids", [])))


class RunDirLock:
    """An exclusive ``flock`` on ``run_dir/.agentrl.lock`` for the lifetime of a run (released on close or when
    the process dies)."""

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / LOCK_FILE
        self._file: IO[str] | None = open(self.path, "a+")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            owner = self._file.read().strip() or "another process"
            self._file.close()
            self._file = None
            raise ConfigError(f"{run_dir} is in use by a running agentrl run (pid {owner}): wait for it to end, "
                              "stop it, or choose another name (name=...)") from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(str(os.getpid()))
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()  # releases the lock
            self._file = None


def claim_run_dir(run_dir: Path, *, resume: bool, overwrite: bool) -> tuple[RunDirLock, ResumePoint | None]:
    """Apply the policy of the module docstring; return the held lock and, for ``resume``, where to continue."""
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: pass one of them")
    lock = RunDirLock(run_dir)
    try:
        if not holds_run(run_dir):
            if resume:
                raise ConfigError(f"--resume: {run_dir} holds no run to resume (no config.yaml); drop --resume to "
                                  "start one")
            return lock, None
        if resume:
            return lock, resume_point(run_dir)
        if overwrite:
            _clear(run_dir)
            return lock, None
        point = resume_point(run_dir)
        done = f"its last checkpoint is step {point.step}" if point.step else "it has no checkpoint yet"
        raise ConfigError(f"{run_dir} already holds a run ({done}): pass --resume to continue it, --overwrite to "
                          "delete it and start again, or give the run another name (name=...)")
    except BaseException:
        lock.close()
        raise


def check_same_run(run_dir: Path, cfg: RunConfig) -> None:
    """Refuse to resume the run in ``run_dir`` with another model or other LoRA settings than it was started with
    (its ``config.yaml``); a ``config.yaml`` this version cannot read is warned about, not refused."""
    from agentrl.launcher.config import load_config

    try:
        old = load_config(run_dir / "config.yaml")
    except ConfigError as exc:
        logger.warning("--resume: cannot compare with the run's config.yaml (%s); resuming with the given settings",
                       str(exc).splitlines()[0])
        return
    # what a resumed run may not change: the run's checkpoints, ``weights/`` and SFT were made with them
    kept = {"model": (old.model, cfg.model), "trainer.lora": (old.trainer.lora, cfg.trainer.lora)}
    changed = [f"{key} was {_said(was)}, now {_said(now)}" for key, (was, now) in kept.items() if was != now]
    if changed:
        raise ConfigError(f"--resume: {run_dir} was started with other settings ({'; '.join(changed)}): resume "
                          "with the command and overrides that started it (`agentrl demo --lora` for a LoRA demo)")


def _said(value: object) -> str:
    dump = getattr(value, "model_dump", None)
    return json.dumps(dump() if dump is not None else value, default=str)


def _clear(run_dir: Path) -> None:
    """Delete everything in ``run_dir`` but the lock file we hold."""
    for child in run_dir.iterdir():
        if child.name == LOCK_FILE:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
