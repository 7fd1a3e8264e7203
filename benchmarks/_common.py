"""What every benchmark's last line carries, and how a benchmark compares two paths (issue 24 item 6).

A figure we can quote says where it was measured and is robust to a shared machine:

- :func:`environment` — the footer: CPU model (short form), ``cores`` (this process's affinity) and ``nproc``,
  the native bf16 flags (``amx_bf16`` / ``avx512_bf16``, from :mod:`agentrl.hardware`) and any ISA cap set in the
  environment, ``onednn_cache`` (``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` where set) and ``preload`` (the first library of
  ``LD_PRELOAD``, e.g. jemalloc, where set), ``dtype`` (where a model runs), the git commit (``-dirty`` with uncommitted changes to tracked
  files), the 1-minute load average at the start and at the end (``load1_start``, ``load1_end``: a figure from a
  busy machine says so), and the versions of the libraries the benchmark exercises (``torch``, ``sglang``,
  ``transformers``, ``redis`` = redis-py…).
- :func:`interleaved` / :func:`ainterleaved` — the floor ``base`` and ``ours`` run alternately (``base, ours``
  in even rounds, ``ours, base`` in odd ones, so load that drifts favours neither) after one untimed warm-up of
  each; the result is the **median of the per-round ratios** ``rate(ours) / rate(base)`` and its range
  (min, max). A ratio whose range contains 1 is **parity**: the difference is inside the round-to-round noise.
  :data:`MIN_ROUNDS` (7) rounds are what a quoted figure needs; quick runs may use fewer and say so
  (``rounds=`` is on the line).
- :func:`start_pinned` — servers on the first CPU, the client (this process) on the others.
- :func:`last_line` — ``name=value`` pairs; floats with a precision that fits their size, ranges as ``lo-hi``,
  spaces in text replaced by ``_`` so that ``line.split()`` then ``split("=", 1)`` reads it back.

Written here rather than with a library: pyperf/pytest-benchmark time one callable at a time and have no notion
of a floor run alternately against ours; the whole module is the ratio arithmetic and a footer.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import math
import os
import re
import statistics
import subprocess
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from agentrl.hardware import BF16_FLAGS, ISA_ENV, cpu_info

T = TypeVar("T")
MIN_ROUNDS = 7  # rounds a quoted ratio needs (fewer: a quick check, not a result)
_NOISE = re.compile(r"\((R|TM|tm|r)\)|\bCPU\b|\bProcessor\b|@.*$|\b\d+-Core\b")


def short_cpu(model: str) -> str:
    """``Intel(R) Xeon(R) Platinum 8488C`` → ``Intel_Xeon_Platinum_8488C``; ``AMD EPYC 9R14 96-Core Processor`` →
    ``AMD_EPYC_9R14``."""
    return "_".join(_NOISE.sub(" ", model).split()) or "unknown"


def git_commit(where: Path = Path(__file__).parent) -> str:
    """Short hash of HEAD, ``-dirty`` when tracked files differ from it; ``unknown`` outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=where).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=where).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}-dirty" if head and dirty else head or "unknown"


def versions(packages: Sequence[str]) -> dict[str, str]:
    """Installed distribution versions (``absent`` when not installed in this interpreter)."""
    out = {}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def environment(*, dtype: str | None = None, packages: Sequence[str] = ("torch",)) -> dict[str, Any]:
    """The footer's fields (see the module docstring). Call it before pinning the process to fewer CPUs:
    ``cores`` is the affinity at the call."""
    model, flags = cpu_info()
    env: dict[str, Any] = {"cpu": short_cpu(model), "cores": len(os.sched_getaffinity(0)),
                           "nproc": os.cpu_count() or 0,
                           "bf16": "+".join(f for f in BF16_FLAGS if f in flags) or "none"}
    caps = [f"{k}={os.environ[k]}" for k in ISA_ENV if k in os.environ]
    if caps:
        env["isa_cap"] = ",".join(caps)
    if "ONEDNN_PRIMITIVE_CACHE_CAPACITY" in os.environ:  # oneDNN's per-shape kernels kept (its default: 1024)
        env["onednn_cache"] = os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]
    preload = os.environ.get("LD_PRELOAD", "").replace(" ", ":").split(":")  # the loader takes either separator
    first = next((os.path.basename(p) for p in preload if p), None)
    if first:
        env["preload"] = first
    if dtype is not None:
        env["dtype"] = dtype
    env["commit"] = git_commit()
    env["load1_start"] = os.getloadavg()[0]
    env.update(versions(packages))
    return env


async def start_pinned(*starts: Callable[[], T]) -> tuple[list[T], str]:
    """Run each ``start`` (which starts a server process) with every thread of this process on the first CPU of
    its affinity, so the servers and their children inherit that CPU, then move this process (the client) to the
    other CPUs: the client's work then does not compete with the servers'. Returns the ``start`` results and a
    description for the report (``server:0,client:1``); on one CPU all share it."""
    from agentrl.launcher.cores import pin_to_cores  # here: only the benchmarks that pin need the launcher

    cpus = sorted(os.sched_getaffinity(0))
    server, client = cpus[:1], cpus[1:] or cpus
    pin_to_cores(server)
    try:
        results = [await asyncio.to_thread(start) for start in starts]
    finally:
        pin_to_cores(client)
    return results, f"server:{','.join(map(str, server))},client:{','.join(map(str, client))}"


@dataclass(frozen=True, slots=True)
class Comparison(Generic[T]):
    """Rounds of two paths run alternately: each side's results and the per-round ratios ours / base."""

    base: list[T]
    ours: list[T]
    ratios: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def range(self) -> tuple[float, float]:
        return min(self.ratios), max(self.ratios)

    @property
    def parity(self) -> bool:
        """The range contains 1: no difference beyond the round-to-round noise."""
        lo, hi = self.range
        return lo <= 1.0 <= hi

    def fields(self, name: str) -> dict[str, Any]:
        """``name`` (the median), ``name_range`` and ``rounds`` for :func:`last_line`."""
        return {name: self.median, f"{name}_range": self.range, "rounds": len(self.ratios)}


def _check(rounds: int) -> None:
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: expected at least 1 ({MIN_ROUNDS} for a figure to quote)")


def interleaved(rounds: int, base: Callable[[], T], ours: Callable[[], T], *,
                rate: Callable[[T], float] = float, warmup: bool = True) -> Comparison[T]:  # type: ignore[assignment]
    """Run ``base`` and ``ours`` alternately for ``rounds`` rounds after an untimed warm-up of each; ``rate``
    turns a result into a rate where higher is better (tokens/s: a result that is seconds needs ``lambda s: 1/s``)."""
    _check(rounds)
    if warmup:
        base()
        ours()
    b: list[T] = []
    o: list[T] = []
    for r in range(rounds):
        for fn, out in ((base, b), (ours, o)) if r % 2 == 0 else ((ours, o), (base, b)):
            out.append(fn())
    return Comparison(b, o, [rate(y) / rate(x) for x, y in zip(b, o)])


async def ainterleaved(rounds: int, base: Callable[[], Awaitable[T]], ours: Callable[[], Awaitable[T]], *,
                       rate: Callable[[T], float] = float,  # type: ignore[assignment]
                       warmup: Callable[[], Awaitable[Any]] | None = None) -> Comparison[T]:
    """:func:`interleaved` for coroutines. ``warmup`` (default: one run of each side) replaces the warm-up when
    a smaller one does (e.g. a few requests to load kernels and fill caches)."""
    _check(rounds)
    if warmup is None:
        await base()
        await ours()
    else:
        await warmup()
    b: list[T] = []
    o: list[T] = []
    for r in range(rounds):
        for fn, out in ((base, b), (ours, o)) if r % 2 == 0 else ((ours, o), (base, b)):
            out.append(await fn())
    return Comparison(b, o, [rate(y) / rate(x) for x, y in zip(b, o)])


def fmt(value: Any) -> str:
    """One value of a last line: floats by size (1234 → ``1234``, 56.78 → ``56.8``, 0.9861 → ``0.986``, 0.0431 →
    ``0.0431``), a (lo, hi) pair as ``lo-hi``, text without spaces."""
    if isinstance(value, tuple) and len(value) == 2:
        return f"{fmt(value[0])}-{fmt(value[1])}"
    if isinstance(value, int):  # bool too
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        size = abs(value)
        if size >= 1000:
            return f"{value:.0f}"
        if size >= 10:
            return f"{value:.1f}"
        if size >= 0.1 or size == 0:
            return f"{value:.3f}"
        return f"{value:.3g}"
    return "_".join(str(value).split()) or "-"


def key_values(pairs: list[str], flag: str) -> dict[str, str]:
    """``KEY=VALUE`` command-line pairs (a repeatable ``flag``) as a mapping; anything else stops the script."""
    bad = [kv for kv in pairs if "=" not in kv or kv.startswith("=")]
    if bad:
        raise SystemExit(f"{flag} {bad[0]!r}: expected KEY=VALUE")
    return dict(kv.split("=", 1) for kv in pairs)


def last_line(figures: Mapping[str, Any], env: Mapping[str, Any]) -> str:
    """``name=value`` pairs: the benchmark's figures, then the environment footer and ``load1_end`` (now)."""
    return " ".join(f"{k}={fmt(v)}" for k, v in {**figures, **env, "load1_end": os.getloadavg()[0]}.items())


def decoder_matmul_params(cfg: Any) -> int:
    """Matmul parameters one token uses in a decoder's layers (attention and MLP projections; not the LM head), from
    an HF config: the FLOP counts of ``trainer_mfu`` and ``decode_mfu`` start from it."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads)
    return layers * (2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size)


def peak_rss_gb() -> float:
    """``VmHWM`` of this process (Linux), in GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


# jemalloc returning freed pages at once: resident memory then follows the live heap (glibc and jemalloc's default
# decay keep freed pages a while, so their RSS shows the past's high-water mark, not what a phase holds)
LIVE_MALLOC_CONF = "dirty_decay_ms:0,muzzy_decay_ms:0"


def live_memory_process() -> bool:
    """Whether this process allocates with jemalloc returning freed pages at once (:data:`LIVE_MALLOC_CONF`),
    asked of the allocator itself (``mallctl``; jemalloc 5's ``ssize_t`` decay options), not of the environment."""
    import ctypes

    try:
        mallctl = ctypes.CDLL(None).mallctl
    except (AttributeError, OSError):
        return False  # no jemalloc in this process
    mallctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p,
                        ctypes.c_size_t]
    mallctl.restype = ctypes.c_int
    value, size = ctypes.c_ssize_t(-1), ctypes.c_size_t(ctypes.sizeof(ctypes.c_ssize_t))
    return all(mallctl(name, ctypes.byref(value), ctypes.byref(size), None, 0) == 0 and value.value == 0
               for name in (b"opt.dirty_decay_ms", b"opt.muzzy_decay_ms"))


def reexec_with_live_memory() -> None:
    """Restart this script (same arguments) with jemalloc preloaded and :data:`LIVE_MALLOC_CONF`, unless this
    process already runs so. Raises SystemExit where that cannot be (not Linux, no jemalloc: agentrl.heap says
    why) or where the restarted process still does not (a second restart would loop)."""
    import sys

    from agentrl.heap import preload_env

    if live_memory_process():
        return
    if os.environ.get("AGENTRL_LIVE_MEMORY_REEXEC"):
        raise SystemExit("--live-memory: restarted with jemalloc preloaded and MALLOC_CONF="
                         f"{LIVE_MALLOC_CONF}, but the allocator does not report those settings (another "
                         "LD_PRELOAD, or a jemalloc older than 5 without decay options?)")
    try:
        env = {**os.environ, **preload_env("jemalloc"), "MALLOC_CONF": LIVE_MALLOC_CONF,
               "AGENTRL_LIVE_MEMORY_REEXEC": "1"}
    except ValueError as exc:
        raise SystemExit(f"--live-memory needs jemalloc: {exc}") from exc
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)  # interpreter flags kept


class RssSampler:
    """This process's resident memory (``VmRSS``, from ``/proc/self/statm``) read every ``interval_s`` by a daemon
    thread, its maximum kept per phase: ``with sampler.phase("step"):`` … ``sampler.peaks["step"]`` (bytes).
    A read is ~10 µs; a spike shorter than the interval can be missed (the kernel's own VmHWM cannot, but it
    keeps the whole process's past high-water mark). The thread holds the GIL only for the read: torch's ops
    release it, so the samples land inside them. A sample counts for a phase only if that phase was still on
    when the read finished (a phase counter, checked under a lock)."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.peaks: dict[str, int] = {}
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._lock = threading.Lock()
        self._phase: tuple[int, str] | None = None  # (serial, name) of the phase on
        self._serial = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def rss(self) -> int:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * self._page

    def _note(self, name: str, value: int) -> None:  # under self._lock
        if value > self.peaks.get(name, 0):
            self.peaks[name] = value

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            on = self._phase
            if on is None:
                continue
            value = self.rss()
            with self._lock:
                if self._phase == on:  # the same phase still on: the reading is inside it
                    self._note(on[1], value)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with self._lock:  # at the start and the end too: a phase shorter than the interval still has a peak
            self._note(name, self.rss())
            self._serial += 1
            self._phase = (self._serial, name)
        try:
            yield
        finally:
            with self._lock:
                self._phase = None
                self._note(name, self.rss())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
