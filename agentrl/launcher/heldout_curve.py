"""Held-out accuracy over a run's time (``data.heldout_every``): evaluations while RL runs, the accuracy curve, and
the time it took to reach a held-out accuracy.

While the rollout side runs, the controller polls the weight version SGLang serves and, each time it reaches the
next multiple of ``heldout_every`` below the final version (the ``after`` evaluation scores that one), runs the
held-out evaluation (:mod:`agentrl.launcher.heldout`: greedy, the same plan as before and after) on the rollout
side, beside the rollouts. One at a time: versions passed while one runs are skipped, the next is the multiple after
the version it started on. The rollout process serves it concurrently with ``run``: it is an asyncio actor on Ray
(its methods are coroutines, so Ray runs them as tasks of one event loop, as it already does for the monitor's
``progress`` polls), and in debug mode a plain object in the controller's loop.

A record, in ``evals.json`` under ``v<N>`` (a resumed run keeps those up to its checkpoint's version, discards the
later ones and evaluates the versions it trains anew again) and its episodes in ``eval_v<N>.jsonl``:
the evaluation's figures plus ``version`` (served when it started), ``version_end`` (served when it ended) and
``versions_changed``: the rollout side kept loading new weights meanwhile (with ``update_mode: interrupt`` even
within a request), so when the two differ its episodes ran on any version between them. ``t_rl_s`` and
``t_run_s`` are its start since RL started and since the run started, in the controller's process (after a
resume both count from the resumed process's start). A failed evaluation never stops the run: its record says
``failed: true`` and ``error``, it is logged and left out of the curve.

The curve (``summary.json: heldout_curve``) is the ``sft`` evaluation (the policy RL starts from, at
``t_rl_s`` 0), the mid-run ones by version, and ``after``. The time to an accuracy is that of the first
evaluation from SFT on (``sft``, mid-run or ``after``) that reached it, taken at its start: its weights were served from then.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

#: How often the served version is read during RL; an evaluation starts at most this late after its version.
POLL_S = 1.0
#: Deadline of one read of the served version (a call to the rollout process, which asks SGLang).
POLL_TIMEOUT_S = 30.0
#: The accuracy whose time-to is reported (``time_to_heldout_0.9_s``, ``time_to_heldout_0.9_rl_s``).
TARGET_ACCURACY = 0.9


@dataclass
class Timeline:
    """The controller's clock for a run: ``run_start``, and ``rl_start`` once RL has started (monotonic seconds)."""

    run_start: float
    rl_start: float | None = None
    clock: Callable[[], float] = field(default=time.monotonic)

    def stamp(self) -> dict[str, float]:
        """Now, since the run started (``t_run_s``) and, once RL started, since then (``t_rl_s``)."""
        now = self.clock()
        out = {"t_run_s": round(now - self.run_start, 2)}
        if self.rl_start is not None:
            out["t_rl_s"] = round(now - self.rl_start, 2)
        return out


def mid_run_label(version: int) -> str:
    return f"v{version}"


def is_mid_run(label: str) -> bool:
    return label.startswith("v") and label[1:].isascii() and label[1:].isdigit()


def forget_later_versions(evals: dict[str, Any], start_version: int,
                          discard: Callable[[str], None] = lambda label: None) -> list[str]:
    """Drop from ``evals`` (in place) the evaluations during RL of versions after ``start_version``, a resumed run's
    checkpoint: their weights were thrown away, the run trains those versions anew. ``discard(label)`` removes
    each one's episodes. Returns the labels dropped, by version."""
    later = sorted((k for k in evals if is_mid_run(k) and int(k[1:]) > start_version), key=lambda k: int(k[1:]))
    for label in later:
        del evals[label]
        discard(label)
    return later


class MidRunEvals:
    """Held-out evaluations at every ``every``-th served version below ``final_version`` (module docstring).

    ``evals`` is the run's dict of evaluation figures (``evals.json``), updated in place; ``save()`` writes it and
    ``write(label, records)`` writes an evaluation's episodes. A resumed run (from ``start_version``, its
    checkpoint's; :func:`forget_later_versions` has dropped the records after it) evaluates from the first multiple
    of ``every`` at or after its checkpoint's version that has no record (or a failed one)."""

    def __init__(self, rollout: Any, *, every: int, final_version: int, evals: dict[str, Any],
                 save: Callable[[], None], write: Callable[[str, list[dict[str, Any]]], None], timeline: Timeline,
                 start_version: int = 0, poll_s: float = POLL_S) -> None:
        if every < 1:
            raise ValueError(f"heldout_every must be >= 1 to evaluate during RL, got {every}")
        self.rollout, self.every, self.final_version = rollout, every, final_version
        self.start_version = start_version
        self.evals, self.save, self.write, self.timeline, self.poll_s = evals, save, write, timeline, poll_s

    async def run(self, stop: asyncio.Event) -> None:
        """Poll and evaluate until ``stop`` is set; an evaluation under way is finished first."""
        due = max(self.every, -(-self.start_version // self.every) * self.every)  # a resumed run: its next multiple
        while not stop.is_set():
            version = await self._served()
            if version is not None and due <= version < self.final_version:
                if self.evals.get(mid_run_label(version), {"failed": True}).get("failed"):
                    await self.evaluate(version)
                due = (version // self.every + 1) * self.every
                continue
            try:
                await asyncio.wait_for(stop.wait(), self.poll_s)
            except TimeoutError:
                pass

    async def _served(self) -> int | None:
        try:
            return int(await asyncio.wait_for(self.rollout.weight_version(), POLL_TIMEOUT_S))
        except Exception as exc:  # the run's own calls see a dead rollout side; this poll only waits for the next
            logger.warning("reading the served weight version failed (retried in %.0f s): %r", self.poll_s, exc)
            return None

    async def evaluate(self, version: int) -> dict[str, Any]:
        """Evaluate what is served (``version`` at the start); the record is kept and saved, also when it failed."""
        label = mid_run_label(version)
        entry: dict[str, Any] = {"label": label, "version": version, **self.timeline.stamp()}
        try:
            figures, records = await self.rollout.evaluate_heldout(label)
            self.write(label, records)
            end = figures.get("version")
            entry = {**figures, **entry, "version_end": end, "versions_changed": end != version}
            if end != version:
                logger.info("held-out eval %s: the served weights changed from v%s to v%s during it", label, version,
                            end)
        except Exception as exc:  # never the run's end: recorded and logged
            logger.warning("held-out eval %s failed; the run goes on: %r", label, exc)
            entry.update(failed=True, error=f"{type(exc).__name__}: {exc}")
        self.evals[label] = entry
        self.save()
        return entry


@asynccontextmanager
async def evaluating_during(evals: MidRunEvals | None) -> AsyncIterator[None]:
    """Runs ``evals`` (None: nothing) while the block runs. On a normal exit an evaluation under way is awaited
    (its record is kept); on an error the poller is cancelled (the rollout side is being stopped anyway)."""
    if evals is None:
        yield
        return
    stop = asyncio.Event()
    task = asyncio.ensure_future(evals.run(stop))
    try:
        yield
    except BaseException:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    stop.set()
    await task


def heldout_curve(evals: dict[str, Any]) -> list[dict[str, Any]]:
    """The held-out accuracy over time: ``sft`` (t_rl_s 0), the scored mid-run evaluations by version, ``after``.
    Each point's ``version`` is the one served when its evaluation started, ``version_end`` when it ended (the same
    where the weights did not change meanwhile, or where the record has no end: ``sft`` and ``after``)."""

    def point(label: str, e: dict[str, Any], **times: Any) -> dict[str, Any]:
        return {"label": label, "version": e.get("version"), "version_end": e.get("version_end", e.get("version")),
                "accuracy": e["accuracy"], "reward_mean": e.get("reward_mean"), "t_rl_s": e.get("t_rl_s"),
                "t_run_s": e.get("t_run_s"), **times}

    curve = []
    if "sft" in evals:
        curve.append(point("sft", evals["sft"], t_rl_s=0.0))
    mid = [(k, e) for k, e in evals.items() if is_mid_run(k) and not e.get("failed")]
    curve += [point(k, e) for k, e in sorted(mid, key=lambda ke: ke[1]["version"])]
    if "after" in evals:
        curve.append(point("after", evals["after"]))
    return curve


def time_to_accuracy(curve: list[dict[str, Any]], target: float, clock: str) -> float | None:
    """``clock`` (``t_run_s`` or ``t_rl_s``) of the first evaluation from SFT on whose accuracy is >= ``target``, or
    None if none was (or it has no time). The SFT point counts: a model that is good after SFT is good from then on
    (``t_rl_s`` 0); leaving it out would report the first mid-run evaluation instead, a time later than the truth."""
    for p in curve:
        if p["accuracy"] >= target:
            return p.get(clock)
    return None


def curve_figures(evals: dict[str, Any]) -> dict[str, Any]:
    """The summary's keys: ``heldout_curve``, ``time_to_heldout_0.9_s`` (since the run started) and
    ``time_to_heldout_0.9_rl_s`` (since RL started), null when never reached."""
    curve = heldout_curve(evals)
    return {"heldout_curve": curve,
            f"time_to_heldout_{TARGET_ACCURACY}_s": time_to_accuracy(curve, TARGET_ACCURACY, "t_run_s"),
            f"time_to_heldout_{TARGET_ACCURACY}_rl_s": time_to_accuracy(curve, TARGET_ACCURACY, "t_rl_s"),
            "heldout_evals_failed": sum(1 for k, e in evals.items() if is_mid_run(k) and e.get("failed"))}
