"""Which cores a process computes on: :func:`pin_to_cores`; the trainer borrowing the rollout side's cores while
that side has nothing to do, and SGLang borrowing the trainer's while the trainer waits (issue 24 item 3).

With split cores and η ≥ 1 the two sides have opposite bottlenecks on different CPUs: where the trainer is the
slow side (the demo on a 2-core CPU: a ~50 s step against ~20 s of generation for it), the rollout side fills its
staleness budget, then idles until the next version is published, and its core with it. So:

- the rollout actor runs an :class:`IdleBeacon`: while no group is in flight, no held-out evaluation and no weight
  load runs, and the staleness gate admits no more groups, it keeps a Redis key alive (``agentrl:<run>:rollout_idle``: its host name and the version it serves;
  a 2 s expiry refreshed every 0.25 s); the staleness gate pokes it whenever a group starts or ends, so the key
  appears and goes within a Redis round trip of the change;
- the trainer (one rank, on CPU, on the same host) asks before every micro-batch (:class:`CoreBorrower`): while
  the key is there and names the newest version it published (the rollout side waits for the trainer, not for a
  weight load about to start), it runs with its own and the rollout's cores (affinity widened, one torch thread
  more per core), otherwise on its own cores as placed; after each step it goes back to its own cores for the
  export and publication, when the rollout side wakes up. A micro-batch is seconds of work, so the switch lags the rollout side by at
  most one micro-batch: for that long both sides share the rollout's cores.

The other way round (``resources.engine_borrows_idle_cores``), for a run bound by the rollout side: the trainer
holds a host-local flag file while it waits for a batch (:class:`TrainerWaitFlag`, path :func:`engine_borrow_flag`)
and the SGLang scheduler, started with the flag's path and the trainer's cores in its environment, decodes with one
more thread per trainer core while the flag is up (``agentrl/engine/sgl_kernel_cpu/sgl_kernel/_borrow.py``; a file,
not Redis: it is read before every forward pass, and the SGLang environment need not have a Redis client).

The host name check keeps a trainer on another node (a cluster, custom Ray resources) from taking its own idle
cores for the rollout's. Everything fails safe: an unreachable Redis, a missing key, another host → no borrowing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from agentrl.launcher.protocol import registry_namespace

logger = logging.getLogger(__name__)


def pin_to_cores(cores: list[int]) -> None:
    """Pin every thread of this process (and so every child it starts later) to ``cores``.

    ``os.sched_setaffinity(0, …)`` pins only the calling thread: a Ray actor runs its methods on other threads
    than the one that would call it, and those floated onto the other side's cores (the rollout worker ran
    on the trainer's core in the async benchmark)."""
    wanted = set(cores)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), wanted)
        except (ProcessLookupError, FileNotFoundError):
            pass  # the thread ended meanwhile


TTL_MS = 2000
REFRESH_S = 0.25


def idle_key(run: str) -> str:
    return f"{registry_namespace(run)}:rollout_idle"


class IdleBeacon:
    """Rollout side: keeps ``key`` alive while ``busy()`` is false; its value is this host's name and the weight
    version the rollout side serves (``served()``)."""

    def __init__(self, client: Any, key: str, busy: Callable[[], bool], served: Callable[[], int], *,
                 refresh_s: float = REFRESH_S, ttl_ms: int = TTL_MS) -> None:
        self.client, self.key, self.busy, self.served = client, key, busy, served
        self.refresh_s, self.ttl_ms = refresh_s, ttl_ms
        self.host = socket.gethostname()
        self._task: asyncio.Task[None] | None = None
        self._idle = False
        self._poked = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def poke(self) -> None:
        """The busy state may have changed: publish it now rather than at the next refresh."""
        self._poked.set()

    async def update(self) -> None:
        """Publish the current state now (also called by the loop)."""
        if not self.busy():
            self._idle = True  # before the SET: if its reply is lost, a later busy state still deletes the key
            await self.client.set(self.key, f"{self.host} {self.served()}", px=self.ttl_ms)
        elif self._idle:
            await self.client.delete(self.key)
            self._idle = False

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.update(), timeout=self.refresh_s * 4)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a Redis hiccup: the key expires by itself, the trainer stops borrowing
                logger.debug("rollout idle beacon: %s", exc)
            try:
                await asyncio.wait_for(self._poked.wait(), timeout=self.refresh_s)
            except TimeoutError:
                pass
            self._poked.clear()

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            await asyncio.wait_for(self.client.delete(self.key), timeout=2.0)
        except Exception as exc:  # the key expires by itself
            logger.debug("rollout idle beacon: cannot delete %s: %s", self.key, exc)


def redis_idle_probe(redis_url: str, key: str, published: Callable[[], int], *,
                     timeout_s: float = 0.5) -> Callable[[], bool]:
    """Trainer side: a function that says whether the rollout side on this host is idle now *and* serves the newest
    version the trainer has published (``published()``): idle with an older version, it is about to load the new one
    and start generating, so its cores are not free. A synchronous client of its own (the trainer's step is
    synchronous code); any error, another host, a malformed value read as busy."""
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    host = socket.gethostname()
    warned = False

    def idle() -> bool:
        nonlocal warned
        try:
            value = client.get(key)
        except redis.RedisError as exc:
            if not warned:
                logger.warning("cannot read the rollout side's idle flag (%s): the trainer keeps its own cores", exc)
                warned = True
            return False
        if value is None:
            return False
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        name, _, served = text.rpartition(" ")
        try:
            return name == host and int(served) >= published()
        except ValueError:
            return False

    return idle


class CoreBorrower:
    """Trainer side: before each micro-batch (:meth:`adjust`), widens this process to ``own + lend`` cores with one
    torch thread per core while ``is_idle()``, and narrows it back to ``own`` otherwise. Counts micro-batches."""

    def __init__(self, own: list[int], lend: list[int], is_idle: Callable[[], bool], *,
                 min_interval_s: float = 0.1) -> None:
        if not own or not lend or set(own) & set(lend):
            raise ValueError(f"expected two disjoint, non-empty core lists, got own {own} and lend {lend}")
        self.own, self.lend, self.is_idle = sorted(own), sorted(lend), is_idle
        self.min_interval_s = min_interval_s
        self.borrowing = False
        self.micro_batches = self.borrowed = 0
        self._own_threads: int | None = None
        self._asked = -float("inf")
        self._idle = False

    def adjust(self) -> None:
        import torch  # here, not at the top: the rollout actor imports this module for its beacon, without torch

        if self._own_threads is None:
            self._own_threads = torch.get_num_threads()
        now = time.monotonic()
        if now - self._asked >= self.min_interval_s:
            self._idle, self._asked = self.is_idle(), now
        wide = self._own_threads + len(self.lend)
        if self._idle and (not self.borrowing or torch.get_num_threads() != wide):  # (a new Trainer resets threads)
            pin_to_cores(self.own + self.lend)
            torch.set_num_threads(wide)
            self.borrowing = True
        elif not self._idle and self.borrowing:
            self._narrow()
        self.micro_batches += 1
        self.borrowed += self.borrowing

    def _narrow(self) -> None:
        import torch

        torch.set_num_threads(self._own_threads or 1)
        pin_to_cores(self.own)
        self.borrowing = False

    def take_share(self) -> float | None:
        """Share of the micro-batches since the last call that ran on borrowed cores (None if there were none)."""
        share = self.borrowed / self.micro_batches if self.micro_batches else None
        self.micro_batches = self.borrowed = 0
        return share

    def close(self) -> None:
        """Back to our own cores; the next :meth:`adjust` asks afresh (a version may have been published since)."""
        self._asked = -float("inf")
        if self.borrowing:
            self._narrow()


# --- the other way round: SGLang borrows the trainer's cores while the trainer waits for rollouts ------------------

def engine_borrow_flag(run_dir: Path | str) -> Path:
    """The host-local file by which the trainer of the run in ``run_dir`` says it waits for rollouts: in ``/dev/shm``
    (else the temporary directory), so that only a trainer on this host can raise it, even with a run directory on
    a shared filesystem. Named by the run directory's resolved path."""
    digest = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"agentrl-trainer-waiting-{digest}"


class TrainerWaitFlag:
    """Trainer side of ``resources.engine_borrows_idle_cores``: :meth:`raised` holds the flag (this process's pid)
    while the trainer waits for a batch; the SGLang scheduler on this host reads it before each forward pass
    (``sgl_kernel/_borrow.py`` of our CPU stand-in) and computes on the trainer's cores too while it is up. A flag
    left by a crashed trainer names a dead pid, which the scheduler ignores; a new trainer removes it at start."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lower()

    @contextlib.contextmanager
    def raised(self) -> Iterator[None]:
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(str(os.getpid()))
            os.replace(tmp, self.path)  # atomic: the scheduler never reads a half-written pid
        except OSError as exc:  # a full or read-only /dev/shm: the trainer goes on, nothing is borrowed
            logger.debug("cannot raise the trainer's wait flag %s: %s", self.path, exc)
        try:
            yield
        finally:
            self.lower()

    def lower(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
