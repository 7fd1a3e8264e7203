"""An ``sglang-router`` process in front of the servers (``engine.router: true``): generation goes through it and
its routing policy (``cache_aware`` by default: a prompt goes where its prefix is cached, balanced by load); weight
updates, pauses and health checks still go to every server directly (the router routes generation, not control).

The router passes SGLang's ``/generate`` answer through unchanged, ``meta_info`` included (token ids, logprobs,
per-token weight versions): tested against the real router and server. It runs in the SGLang environment's
interpreter (``engine.python``) when one is set, else in agentrl's; the ``sglang-router`` package must be installed
there (it is in ``make install``'s venv).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from agentrl.engine.server import _signal_group, free_port
from agentrl.errors import EngineError

logger = logging.getLogger(__name__)

POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")


class SGLangRouter:
    """One ``sglang_router.launch_router`` process in its own process group; ``start()`` returns once it answers."""

    def __init__(self, workers: Sequence[str], *, policy: str = "cache_aware", python: str | None = None,
                 host: str = "127.0.0.1", log_path: Path | None = None, startup_timeout_s: float = 60.0) -> None:
        if policy not in POLICIES:
            raise EngineError(f"router policy {policy!r}: expected one of {', '.join(POLICIES)}")
        if not workers:
            raise EngineError("a router needs at least one SGLang server behind it")
        self.workers, self.policy, self.python, self.host = list(workers), policy, python, host
        self.port = free_port(host)
        self.log_path, self.startup_timeout_s = log_path, startup_timeout_s
        self.name = "sglang-router"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def command(self) -> list[str]:
        return [self.python or sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *self.workers,
                "--policy", self.policy, "--host", self.host, "--port", str(self.port), "--log-level", "warn",
                "--prometheus-port", str(free_port(self.host)), "--prometheus-host", self.host]

    def start(self) -> SGLangRouter:
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")
        self._proc = subprocess.Popen(self.command(), stdout=self._log or subprocess.DEVNULL,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self.stop()
                raise EngineError(f"sglang-router exited with {self._proc.returncode} at start; is the sglang-router "
                                  f"package installed in {self.python or sys.executable}? See {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        logger.info("sglang-router (%s) on %s in front of %s", self.policy, self.url, self.workers)
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise EngineError(f"sglang-router did not answer within {self.startup_timeout_s:g}s; see {self.log_path}")

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            _signal_group(proc.pid, signal.SIGKILL)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None
