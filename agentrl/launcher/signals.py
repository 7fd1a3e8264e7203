"""SIGTERM stops a run the way Ctrl-C does: every process of the run stopped, the run directory left resumable.

A cluster scheduler (SLURM's ``scancel``, Kubernetes, ``timeout``) and ``kill`` send SIGTERM, not SIGINT. Python's
default for it is to die at once, and Ray's core worker installs a C++ handler for it during ``ray.init`` that aborts
the controller (seen: ``*** SIGTERM received ***``, exit 134) without our clean-up: no ledger sweep of the SGLang
servers, no closing of the queue. So the controller routes SIGTERM to its SIGINT path (asyncio.run's handler, which
cancels the main task so that every ``finally`` and exit stack runs; or a KeyboardInterrupt where SIGINT is ignored,
as in a background job of a non-interactive shell), and installs that again after ``ray.init``."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

logger = logging.getLogger(__name__)

_received = threading.Event()


def stop_on_sigterm() -> None:
    """Route SIGTERM to the SIGINT path in this process (the main thread only: Python's rule for handlers)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    else:
        logger.debug("SIGTERM handler not installed: not on the main thread")


def terminated() -> bool:
    """Whether this process received SIGTERM (the CLI then exits 143, as a process killed by it would)."""
    return _received.is_set()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    first = not _received.is_set()
    _received.set()
    if first:
        logger.warning("SIGTERM: stopping every process of the run")
    on_sigint = signal.getsignal(signal.SIGINT)
    if callable(on_sigint):  # asyncio.run's (cancels the main task) or Python's default_int_handler (raises)
        on_sigint(signal.SIGINT, frame)
    else:  # SIG_IGN or SIG_DFL: nothing would stop the run
        raise KeyboardInterrupt
