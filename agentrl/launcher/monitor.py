"""Seeing a run go: a live progress line (rich), Prometheus gauges on ``/metrics``, TensorBoard scalars.

The controller polls two small sources every ``interval_s``: the trainer's ``metrics.jsonl`` (new lines only)
and the rollout actor's ``progress()`` (counters and queue depth). Nothing here touches trajectories.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentrl.launcher.trackers import Tracker

logger = logging.getLogger(__name__)

GAUGES = {
    "step": "trainer steps done",
    "weight_version": "latest published weight version",
    "reward_mean": "mean reward of the last trained batch",
    "staleness_mean": "mean staleness (versions) of the last trained batch",
    "staleness_max": "max staleness of the last trained batch",
    "rollout_tokens_per_s": "model tokens generated per second, filtered groups included (smoothed)",
    "rollout_pass_rate": "share of solved episodes of the newest weight version, filtered groups included",
    "queue_length": "trajectories in the queue (waiting + pending)",
    "queue_pending": "trajectories read by the trainer and not acknowledged yet (acks follow checkpoints)",
    "served_version": "weight version the rollout engine serves",
}


class RunMonitor:
    def __init__(self, run_dir: Path, total_steps: int, *, live: bool = True, prometheus_port: int | None = 0,
                 tensorboard: bool = True, interval_s: float = 2.0, trackers: Sequence[Tracker] = ()) -> None:
        self.run_dir = run_dir
        self.trackers = list(trackers)
        self._tracker_failed: set[int] = set()
        self.total_steps = total_steps
        self.interval_s = interval_s
        self.values: dict[str, float] = {}
        self.line = ""  # the last live line
        self._offset = 0
        self._last_tokens: tuple[float, float] | None = None
        self._live: Any = None
        self._tb: Any = None
        self._http: Any = None
        self.metrics_url: str | None = None
        if prometheus_port is not None:
            self._start_prometheus(prometheus_port)
        if tensorboard:
            # TensorBoard's own writer (numpy and protobuf only), not torch.utils.tensorboard: this runs in the
            # controller, which otherwise never imports torch (~0.5 GB of RSS)
            from tensorboard.summary import Writer

            self._tb = Writer(str(run_dir / "tensorboard"))
        if live and sys.stderr.isatty():
            from rich.console import Console
            from rich.live import Live

            self._live = Live(console=Console(stderr=True), refresh_per_second=2, transient=False)
            self._live.start()
        self._last_log = 0.0

    def _start_prometheus(self, port: int) -> None:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        self._registry = CollectorRegistry()  # our own registry: no process-wide state
        self._gauges = {k: Gauge(f"agentrl_{k}", doc, registry=self._registry) for k, doc in GAUGES.items()}
        server, _thread = start_http_server(port, addr="127.0.0.1", registry=self._registry)
        self._http = server
        self.metrics_url = f"http://127.0.0.1:{server.server_port}/metrics"
        (self.run_dir / "logs" / "metrics_url").write_text(self.metrics_url)
        logger.info("Prometheus metrics at %s", self.metrics_url)

    def _read_new_metrics(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        with open(path) as f:
            f.seek(self._offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self._offset += len(complete.encode())
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def update(self, progress: dict[str, Any] | None) -> None:
        for rec in self._read_new_metrics():
            for k in ("step", "weight_version", "reward_mean", "staleness_mean", "staleness_max"):
                if rec.get(k) is not None:
                    self.values[k] = float(rec[k])
            if self._tb is not None:
                for k, v in rec.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                        self._tb.add_scalar(f"train/{k}", v, rec["step"])
                self._tb.flush()
            self._track(rec)
        if progress:
            # every generated token counts, also those of groups dynamic sampling filtered out
            now, tokens = time.monotonic(), float(progress.get("generated_tokens", 0))
            if self._last_tokens is not None and now > self._last_tokens[0]:
                rate = (tokens - self._last_tokens[1]) / (now - self._last_tokens[0])
                old = self.values.get("rollout_tokens_per_s")  # smoothed over ~30 s of polls
                self.values["rollout_tokens_per_s"] = rate if old is None else old + 0.1 * (rate - old)
            self._last_tokens = (now, tokens)
            self.values["queue_length"] = float(progress.get("queue_length", 0))
            self.values["queue_pending"] = float(progress.get("queue_pending", 0))
            solved = progress.get("solved_by_version") or {}
            if solved:
                s, n = solved[max(solved, key=int)]
                self.values["rollout_pass_rate"] = s / n if n else 0.0
            if progress.get("version") is not None:
                self.values["served_version"] = float(progress["version"])
        if self._http is not None:
            for k, v in self.values.items():
                self._gauges[k].set(v)
        self._render()

    def _track(self, rec: dict[str, Any]) -> None:
        numbers = {f"train/{k}": float(v) for k, v in rec.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        for i, tracker in enumerate(self.trackers):
            try:
                tracker.log(numbers, step=int(rec["step"]))
            except Exception as exc:  # a tracker's outage must not stop training; metrics.jsonl has it all
                if i not in self._tracker_failed:
                    self._tracker_failed.add(i)
                    logger.warning("%s.log failed (reported once; the run goes on): %r", type(tracker).__name__, exc)

    def finish(self, summary: dict[str, Any]) -> None:
        """The run's summary to every tracker, then close them."""
        for tracker in self.trackers:
            try:
                tracker.summary(summary)
            except Exception as exc:
                logger.warning("%s.summary failed: %r", type(tracker).__name__, exc)
        self._close_trackers()

    def _close_trackers(self) -> None:
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            try:
                tracker.close()
            except Exception as exc:
                logger.warning("%s.close failed: %r", type(tracker).__name__, exc)

    def _render(self) -> None:
        v = self.values
        line = (f"step {int(v.get('step', 0))}/{self.total_steps}  version {int(v.get('weight_version', 0))} "
                f"(served {int(v.get('served_version', 0))})  reward {v.get('reward_mean', 0):.3f}  "
                f"pass {v.get('rollout_pass_rate', 0):.2f}  "
                f"rollout {v.get('rollout_tokens_per_s', 0):.0f} tok/s  "
                f"queue {int(v.get('queue_length', 0) - v.get('queue_pending', 0))} (+{int(v.get('queue_pending', 0))} "
                "read, unacked)  "
                f"staleness {v.get('staleness_mean', 0):.2f}/{int(v.get('staleness_max', 0))}")
        self.line = line
        if self._live is not None:
            from rich.text import Text

            self._live.update(Text(line))
        elif time.monotonic() - self._last_log > 30:
            self._last_log = time.monotonic()
            logger.info("%s", line)

    async def follow(self, rollout: Any) -> None:
        """Poll until cancelled."""
        while True:
            try:
                progress = await asyncio.wait_for(rollout.progress(), 10)
            except Exception:  # the rollout side may be busy or restarting; the view just skips a beat
                progress = None
            self.update(progress)
            await asyncio.sleep(self.interval_s)

    def close(self) -> None:
        self._close_trackers()
        if self._live is not None:
            self._live.stop()
        if self._tb is not None:
            self._tb.close()
        if self._http is not None:
            self._http.shutdown()
