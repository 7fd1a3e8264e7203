"""The SGLang scheduler borrowing the trainer's cores while the trainer waits for rollouts (issue 24 item 3).

The mirror of ``agentrl.launcher.cores.CoreBorrower``: with split cores on one CPU host, a rollout-bound run leaves
the trainer's cores idle while the trainer waits for the next batch (43 % of the RL time of the AVX2 demo), and
SGLang's CPU decode runs 1.37x faster on two threads over two cores than on one (docs/results.md). The trainer
holds a flag file while it waits (``agentrl.launcher.cores.TrainerWaitFlag``: its pid, in ``/dev/shm``, so only a
trainer on this host can raise it); before every forward pass (at most every ``CHECK_S``) the scheduler looks at
it, and while it is there (for at least ``SETTLE_S``: a wait of a few milliseconds between two ready batches is not
worth a switch) and its pid is alive, the forward pass runs with one more torch thread per lent core and the
process's threads may run on the lent cores too; otherwise on its own cores and threads as started. The switch
lags the trainer by at most one forward pass (a decode step: about a second here), during which both share the
trainer's cores.

Set by the launcher in the server's environment: ``AGENTRL_BORROW_FLAG`` (the flag's path) and
``AGENTRL_BORROW_CORES`` (comma-separated core ids to borrow). Written for this stand-in only: it has no
dependency on agentrl, which the SGLang environment may not have. Everything fails safe: a missing or unreadable
flag, a dead pid or a malformed value → no borrowing.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

CHECK_S = 0.1
SETTLE_S = 0.5


def _pin(cores: set[int]) -> None:
    """Every thread of this process (OpenMP workers and the scheduler's own threads) onto ``cores``."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            pass  # the thread ended meanwhile


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


class EngineCoreBorrowing:
    """Call :meth:`adjust` before each forward pass, on the thread that runs it (torch's thread count is that
    thread's OpenMP setting)."""

    def __init__(self, flag: str, lend: list[int], *, check_s: float = CHECK_S, settle_s: float = SETTLE_S,
                 log: Any = None) -> None:
        self.flag, self.lend = flag, sorted(set(lend))
        self.check_s, self.settle_s = check_s, settle_s
        self.log = log if log is not None else (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.borrowing = False
        self.own: set[int] | None = None
        self.own_threads = 1
        self.forwards = self.borrowed_forwards = 0
        self.borrowed_s = 0.0
        self._asked = -float("inf")
        self._since = 0.0

    def trainer_waiting(self) -> bool:
        try:
            with open(self.flag) as f:
                raised_at = os.fstat(f.fileno()).st_mtime
                pid = int(f.read().strip() or "-1")
        except (OSError, ValueError):
            return False
        return pid > 0 and time.time() - raised_at >= self.settle_s and _alive(pid)

    def adjust(self) -> None:
        if self.own is None:
            self.own = set(os.sched_getaffinity(0))
            self.own_threads = torch.get_num_threads()
            self.lend = [c for c in self.lend if c not in self.own]
        self.forwards += 1
        now = time.monotonic()
        if now - self._asked >= self.check_s and self.lend:
            self._asked = now
            waiting = self.trainer_waiting()
            if waiting and not self.borrowing:
                _pin(self.own | set(self.lend))  # first: OpenMP workers started next inherit the wider affinity
                torch.set_num_threads(self.own_threads + len(self.lend))
                self.borrowing, self._since = True, now
            elif not waiting and self.borrowing:
                self._narrow(now)
        self.borrowed_forwards += self.borrowing

    def wrap(self, init_forward_metadata: Any) -> Any:
        """The attention backend's ``init_forward_metadata`` (called once per forward pass, on the thread that runs
        it), calling :meth:`adjust` first."""
        def wrapped(backend: Any, forward_batch: Any) -> Any:
            self.adjust()
            return init_forward_metadata(backend, forward_batch)

        wrapped.agentrl_borrow = True  # type: ignore[attr-defined]
        return wrapped

    def _narrow(self, now: float) -> None:
        assert self.own is not None  # set by the first adjust, before any widening
        torch.set_num_threads(self.own_threads)
        _pin(self.own)
        spent = now - self._since
        self.borrowed_s += spent
        self.borrowing = False
        self.log(f"agentrl: borrowed cores {self.lend} for {spent:.1f} s while the trainer waited "
                 f"({self.borrowed_forwards}/{self.forwards} forward passes, {self.borrowed_s:.0f} s in all)")


def from_environment() -> EngineCoreBorrowing | None:
    """The borrowing the launcher asked for in this process's environment, or None."""
    flag, cores = os.environ.get("AGENTRL_BORROW_FLAG"), os.environ.get("AGENTRL_BORROW_CORES")
    if not flag or not cores:
        return None
    try:
        lend = [int(c) for c in cores.split(",") if c.strip()]
    except ValueError:
        print(f"agentrl: AGENTRL_BORROW_CORES={cores!r} is not a comma-separated list of core ids: no borrowing",
              file=sys.stderr, flush=True)
        return None
    return EngineCoreBorrowing(flag, lend) if lend else None
