"""Memory accounting of a run: the resident memory (RSS) of every process it started, sampled on each node.

Each process of a run that starts processes samples its own side (a :class:`MemorySampler`: a daemon thread, one
pass every ``interval_s``) and reports it by a path it already has to the controller: the controller samples
itself, the embedded Redis and Ray's daemons; the rollout process itself, each SGLang server's whole process tree
(launcher, scheduler, detokenizer, …) and its other children (sandbox workers, the math checker pool, the router);
each trainer rank itself (returned by its ``train`` call). :func:`combine` turns the reports into ``summary.json``'s
``memory`` block:

    per_process[role]   = max over samples t of  Σ_{p of role alive at t} VmHWM_p(t)
                          (a single process: its kernel-kept peak, exact even between samples; a tree: an upper
                          bound of the tree's peak that short-lived children, e.g. sandbox runs, do not inflate)
    sum_of_peaks_gb     = Σ_role per_process[role]                         (an upper bound of the next)
    peak_concurrent_gb  = max over wall-clock seconds s of  Σ_node  Σ_{p sampled there} RSS_p(s)
    peak_concurrent_anon_gb = the same over RssAnon_p(s): memory no file backs, each page counted once (the
                          figure a memory limit enforces, less shared memory such as /dev/shm weight files)
    peak_anon_by_role   = that second's RssAnon per role (what to cut to lower the peak), and
    peak_anon_at_s      = when it was, in seconds after the first sample of the run

The concurrent figure is exact (to the sampling interval; a spike shorter than it is missed, VmHWM catches it in
the sum of peaks) for processes on one node. Across nodes each node's series is aligned by wall-clock second, so it
is as good as the nodes' clocks agree. RSS counts a page shared by several processes once per process (libraries,
``/dev/shm`` weights): the sums overstate, never understate. PSS (``/proc/<pid>/smaps_rollup``) would split them
exactly, but one read walks the process's page tables: 10-50 ms of CPU per process here (the demo's trainer rank,
6 GB: 48 ms), a hundred times an RSS read; in that demo Σ PSS of its five largest processes was 14 % below their
Σ RSS. ``RssAnon`` comes with the same read and leaves the shared pages out: the demo run inside a memory cgroup
(``benchmarks/time_to_accuracy.py --memory-limit-gb``) had its processes' Σ RSS peak at 13.4 GB where the kernel
counted 10.9 GB of anonymous and shared memory.

GB here are GiB (2**30 bytes).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import psutil

logger = logging.getLogger(__name__)

GIB = 2**30


@dataclass(frozen=True, slots=True)
class _Watch:
    role: str
    pid: Callable[[], int | None]  # read at every pass: a restarted SGLang server has a new pid
    tree: bool  # with every descendant not claimed by an earlier watch


class Memory(NamedTuple):
    rss: int
    peak: int  # the kernel's peak RSS (VmHWM)
    anon: int  # RssAnon: resident memory no file backs


def read_memory(pid: int) -> Memory | None:
    """The memory of ``pid`` in bytes, or None if it is gone. Linux: ``VmRSS``, ``VmHWM`` and ``RssAnon`` of
    ``/proc/<pid>/status`` (one read; the kernel's peak, which psutil does not expose); elsewhere psutil's
    ``rss``, where the platform keeps one (Windows' ``peak_wset``) its peak, else the RSS itself, and the RSS as
    anonymous (an upper bound)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        if Path("/proc/self/status").exists():
            return None  # Linux, and the process is gone
        try:
            info = psutil.Process(pid).memory_info()
        except psutil.Error:
            return None
        return Memory(info.rss, max(info.rss, getattr(info, "peak_wset", 0)), info.rss)
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    if "VmRSS" not in fields:  # a zombie or kernel thread: no memory of its own
        return None
    rss = int(fields["VmRSS"].split()[0]) * 1024
    anon = int(fields["RssAnon"].split()[0]) * 1024 if "RssAnon" in fields else rss  # RssAnon: Linux ≥ 4.5
    return Memory(rss, int(fields.get("VmHWM", fields["VmRSS"]).split()[0]) * 1024, anon)


class MemorySampler:
    """Samples the RSS of the watched processes every ``interval_s`` on a daemon thread (:meth:`start`).

    Watches are claimed in the order they were added: a process belongs to the first watch that lists it, so a tree
    watch added last gets "everything else under this pid" (the pid itself too unless an earlier watch has it).
    Pids in ``skip()`` (and their subtrees) are someone else's to sample: e.g. Ray actors under the controller's Ray
    daemons, which sample themselves.

    Cost: one pass lists the machine's processes once (psutil, for the parent map) and reads one
    ``/proc/<pid>/status`` per watched process: 4.3 ms of CPU per pass (3.8 ms of it the process list) with 79
    processes on the machine, 21 of them watched (the 2-core Xeon during a demo run, mean of 300 passes): ~0.4 % of
    one core at the default 1 s. It grows with the machine's process count, not with the run's length."""

    def __init__(self, interval_s: float = 1.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0 seconds, got {interval_s}")
        self.interval_s = interval_s
        self._watches: list[_Watch] = []
        self._skip: Callable[[], Iterable[int]] = lambda: ()
        self._lock = threading.Lock()
        self._peaks: dict[str, int] = {}  # role → max over passes of Σ VmHWM of its live processes
        self._seen: set[tuple[int, float]] = set()  # (pid, start time): distinct processes
        self._series: dict[int, int] = {}  # wall-clock second → max Σ RSS of a pass in it
        self._anon_series: dict[int, int] = {}  # wall-clock second → max Σ RssAnon of a pass in it
        self._anon_roles: dict[int, dict[str, int]] = {}  # wall-clock second → that pass's RssAnon per role
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, role: str, pid: int | Callable[[], int | None], *, tree: bool = False) -> None:
        """Sample ``pid`` as ``role`` (a callable is asked for the pid at every pass; None = not running now),
        with its descendants if ``tree``."""
        provider = pid if callable(pid) else (lambda p=pid: p)
        with self._lock:
            self._watches.append(_Watch(role, provider, tree))
            self._peaks.setdefault(role, 0)

    def skip(self, pids: Callable[[], Iterable[int]]) -> None:
        """Leave out these pids and their subtrees (asked at every pass)."""
        self._skip = pids

    def sample(self) -> int:
        """One pass; returns the summed RSS of the watched processes (bytes)."""
        children: dict[int, list[int]] = {}
        started: dict[int, float] = {}
        for p in psutil.process_iter(["ppid", "create_time"]):
            children.setdefault(p.info["ppid"], []).append(p.pid)
            started[p.pid] = p.info["create_time"] or 0.0
        with self._lock:
            watches = list(self._watches)
        claimed = set(self._skip())
        total = anon = 0
        hwm: dict[str, int] = {}
        by_role: dict[str, int] = {}
        seen = []
        for w in watches:
            root = w.pid()
            if root is None or root not in started:
                continue
            pids = [] if root in claimed else [root]  # a tree under a claimed root: its descendants only
            # breadth-first over one process table per pass, never entering what an earlier watch or skip() claimed
            # (psutil's children(recursive=True) rescans the table per call and cannot prune a claimed subtree)
            if w.tree:
                frontier = [root]
                for pid in frontier:
                    fresh = [c for c in children.get(pid, ()) if c not in claimed]
                    frontier += fresh
                    pids += fresh
            for pid in pids:
                claimed.add(pid)
                mem = read_memory(pid)
                if mem is None:
                    continue
                total += mem.rss
                anon += mem.anon
                by_role[w.role] = by_role.get(w.role, 0) + mem.anon
                hwm[w.role] = hwm.get(w.role, 0) + mem.peak
                seen.append((pid, started.get(pid, 0.0)))
        second = int(time.time())
        with self._lock:
            for role, value in hwm.items():
                self._peaks[role] = max(self._peaks.get(role, 0), value)
            self._seen.update(seen)
            self._series[second] = max(self._series.get(second, 0), total)
            if anon >= self._anon_series.get(second, 0):
                self._anon_series[second] = anon
                self._anon_roles[second] = by_role
        return total

    def start(self) -> MemorySampler:
        self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            try:
                self.sample()
            except Exception as exc:  # accounting must never take the run down; the next pass retries
                logger.debug("memory sampling pass failed: %r", exc)
            if self._stop.wait(self.interval_s):
                return

    def stop(self) -> None:
        """Stop sampling after one last pass (a process that ends with the run is still counted)."""
        if self._thread is None or self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            self.sample()
        except Exception as exc:
            logger.debug("memory sampling pass failed: %r", exc)

    def report(self) -> dict[str, Any]:
        """This node's figures, JSON-able (they travel back to the controller as the return value of a Ray call):
        ``peaks`` (role → bytes), ``processes`` (distinct processes seen), ``series`` and ``anon_series``
        ([second, bytes] pairs of Σ RSS and Σ RssAnon), ``anon_roles`` ([second, {role: bytes}] of the same
        passes as ``anon_series``), ``host`` and ``total_ram``."""
        with self._lock:
            return {"host": socket.gethostname(), "total_ram": psutil.virtual_memory().total,
                    "interval_s": self.interval_s, "peaks": {r: v for r, v in self._peaks.items() if v},
                    "processes": len(self._seen), "series": sorted(self._series.items()),
                    "anon_series": sorted(self._anon_series.items()),
                    "anon_roles": sorted(self._anon_roles.items())}


def combine(reports: Iterable[Mapping[str, Any] | None], *, total_ram: int | None = None) -> dict[str, Any]:
    """``summary.json``'s ``memory`` block from the nodes' :meth:`MemorySampler.report` s (None: a side that had
    nothing to report). The concurrent peak sums, for every second any report sampled, each report's newest sample
    at or before it, if it is at most three intervals old (else that side was not running then)."""
    present = [r for r in reports if r]
    per_role: dict[str, int] = {}
    for r in present:
        for role, value in r["peaks"].items():
            per_role[role] = per_role.get(role, 0) + int(value)
    ram = total_ram if total_ram is not None else psutil.virtual_memory().total
    anon_peak, anon_at = _concurrent_peak(present, "anon_series")
    by_role: dict[str, int] = {}
    if anon_at is not None:
        for r in present:
            roles = _sample_at(r, "anon_roles", anon_at)
            for role, value in (roles or {}).items():
                by_role[role] = by_role.get(role, 0) + int(value)
    first = min((int(t) for r in present for t, _ in r.get("anon_series", ())), default=None)
    return {"peak_concurrent_gb": _gb(_concurrent_peak(present, "series")[0]),
            "peak_concurrent_anon_gb": _gb(anon_peak),
            "peak_anon_by_role": {role: _gb(v) for role, v in sorted(by_role.items())},
            "peak_anon_at_s": anon_at - first if anon_at is not None and first is not None else None,
            "sum_of_peaks_gb": _gb(sum(per_role.values())),
            "per_process": {role: _gb(v) for role, v in sorted(per_role.items())},
            "processes": sum(int(r["processes"]) for r in present),
            "hosts": sorted({r["host"] for r in present}), "total_ram_gb": _gb(ram),
            "interval_s": max((float(r.get("interval_s", 1.0)) for r in present), default=None)}


def _concurrent_peak(reports: list[Mapping[str, Any]], key: str) -> tuple[int, int | None]:
    """The largest sum over reports of each one's newest sample at or before a second, and that second."""
    series = [sorted((int(t), int(v)) for t, v in r.get(key, ())) for r in reports]
    seconds = sorted({t for s in series for t, _ in s})
    peak, peak_at, cursors = 0, None, [0] * len(series)
    for t in seconds:
        summed = 0
        for i, s in enumerate(series):
            while cursors[i] + 1 < len(s) and s[cursors[i] + 1][0] <= t:
                cursors[i] += 1
            at, value = s[cursors[i]] if s else (t + 1, 0)
            if at <= t and _fresh(reports[i], at, t):
                summed += value
        if summed > peak:
            peak, peak_at = summed, t
    return peak, peak_at


def _fresh(report: Mapping[str, Any], at: int, t: int) -> bool:
    """A sample taken at ``at`` still counts at second ``t``: at most three of its report's intervals old."""
    return t - at <= 3 * float(report.get("interval_s", 1.0))


def _sample_at(report: Mapping[str, Any], key: str, t: int) -> Any:
    """``report``'s newest ``key`` sample at or before second ``t`` if at most three intervals old (as
    :func:`_concurrent_peak` counts it), else None."""
    found = None
    for at, value in sorted(((int(a), v) for a, v in report.get(key, ())), key=lambda x: x[0]):
        if at > t:
            break
        found = (at, value)
    if found is None or not _fresh(report, found[0], t):
        return None
    return found[1]


def _gb(n: int) -> float:
    return round(n / GIB, 3)


def report_line(memory: Mapping[str, Any]) -> str:
    """The line of ``report.md``: "peak memory: X GB concurrent (A GB of it anonymous, sum of peaks Y GB) over N
    processes seen in the run (short-lived ones included); …" (N counts every sandbox run too: 5,461 in a demo)."""
    per = memory.get("per_process", {})
    sglang = sum(v for k, v in per.items() if k.startswith("sglang"))
    anon = (f"{memory['peak_concurrent_anon_gb']:.2f} GB of it anonymous, "
            if memory.get("peak_concurrent_anon_gb") is not None else "")  # older summaries have no anon figure
    parts = [f"peak memory: {memory['peak_concurrent_gb']:.2f} GB concurrent ({anon}sum of peaks "
             f"{memory['sum_of_peaks_gb']:.2f} GB) over {memory['processes']} processes seen in the run "
             "(short-lived ones included)"]
    if "trainer-0" in per:
        parts.append(f"trainer rank 0 {per['trainer-0']:.2f} GB")
    if sglang:
        parts.append(f"SGLang {sglang:.2f} GB")
    if by_role := memory.get("peak_anon_by_role"):
        top = ", ".join(f"{role} {gb:.2f}" for role, gb in sorted(by_role.items(), key=lambda x: -x[1]))
        parts.append(f"anonymous at its peak ({memory.get('peak_anon_at_s')} s in): {top} GB")
    return "; ".join(parts) + f" (GB = 2^30 bytes; machine RAM {memory['total_ram_gb']:.1f} GB)."


def controller_sampler(redis_pid: int | None) -> MemorySampler:
    """The controller's sampler, started: this process and the embedded Redis it started (``redis_pid``; None
    with an external one). :func:`agentrl.launcher.placement.place` adds Ray's daemons, or in debug mode the
    rollout worker its servers and children."""
    sampler = MemorySampler()
    sampler.watch("driver", os.getpid())
    if redis_pid is not None:
        sampler.watch("redis", redis_pid)
    return sampler.start()
