"""How a CPU process's heap serves tensors: keep freed memory for reuse, or return it (glibc's ``mallopt``).

PyTorch on a CPU allocates every tensor with ``malloc`` (no caching allocator). glibc serves blocks above its mmap
threshold with their own mapping, returned to the kernel on ``free``; smaller ones come from the heap, which keeps
freed memory for reuse and returns only its free top. The threshold starts at 128 KiB and *rises* to the size of
each mapped block freed, up to 32 MiB: after a trainer's first step, activations and logit chunks of a few MiB
are carved from the heap, which can fragment as micro-batch shapes change from step to step. Fixing the
threshold (which also turns the rise off) maps every block at or above it that the heap cannot serve from its free
space, and returns the heap's free top above twice the threshold; the cost is a mapping and its page faults per
large tensor. Measured on the demo's trainer (docs/results.md): over RL steps alone (benchmarks/trainer_memory.py)
~0.2 GB less at its peak, with CPU cost none seen on an AMX Xeon but a quarter of the step's CPU time in the kernel
on an AVX2 EPYC (7 million page faults a step: every activation and gathered weight is fresh memory); over
cold-start SFT steps then RL steps, as in the demo, 1.2 GB less (SFT's longer micro-batches set glibc's peak) at
~35 % more CPU a step on a Xeon without AMX.

:func:`never_map` is the other way, ``mmap_threshold_kb``'s default (on glibc): no block gets a mapping, freed
memory stays in the heap and is reused by the next micro-batch without a page fault (only a free top above 2 GiB is
returned). The process's RSS then stays at its peak between steps; measured over 10 steps of changing shapes it levels off after the third
(fp32 demo trainer: 6.1 GB) rather than growing.

glibc only (``MALLOC_MMAP_THRESHOLD_`` in the environment does the same for a whole process tree at its start,
see ``engine.env``); elsewhere (musl, macOS) nothing is changed.

``trainer.malloc: jemalloc`` replaces glibc's allocator in the trainer ranks' processes (preloaded at their start:
:func:`preload_env`; Ray's wheel ships the library); ``auto``, the default, does so wherever it can
(:func:`choose`). Its size classes and decay-based purging (freed pages go back to the kernel ~10 s after they were
last used) fragment less than glibc's heap: on the demo's trainer (SFT then RL steps, one core each,
docs/results.md) its peak was that of the 1 MiB threshold (fp32 full fine-tuning 5.65 GB, LoRA 2.27, against 6.88
and 3.48 with ``never``) at ~10 % more CPU a step where the threshold cost ~35 %. In bf16 glibc's heap did not
level off: 10 RL steps of changing shapes grew it to 8.8 GB and growing (4.0 GB over its first step), jemalloc's to
5.4 GB (1.7 over its first, level from the eighth), for 6 % more CPU a step, with the same 2.5 GB of live tensors
in both. Most of that growth was oneDNN's kernels, compiled and kept for each new matmul shape; with the trainer's
``pad_to_multiple_of`` (micro-batches in a few shapes) glibc's bf16 heap levelled at 5.3 GB over the AMX demo, but
its step was no faster there than jemalloc's and it held ~0.8 GiB more, so bf16 stays on jemalloc. With purging
off (``MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1``) the same trainer grew past 21 GB: do not turn it off.

jemalloc's leaner heap is paid for in page faults: it returns freed pages to the kernel, and the next micro-batch's
activations fault them back in. On an AVX2-only EPYC (fp32, the demo's RL step, two processes side by side) that was
~24 M minor faults and ~25 s of kernel time a step: a step 1.3x glibc's (``never``), whose fp32 heap levels off (6.7
GB against jemalloc's 5.4). So ``auto`` weighs the two by what the machine is (:func:`choose`): an fp32 CPU full
fine-tuning trainer on a machine with at least :data:`FAST_HEAP_MIN_GIB` of memory (its memory cgroup's limit if
lower, :func:`memory_limit_bytes`) gets glibc's faster heap; a bf16 trainer (glibc's heap grows without bound), a
LoRA trainer (there to save memory) or a smaller machine gets jemalloc. Tried and dropped (docs/results.md): a
longer decay, no oversize arena, transparent huge pages, lazy purging (``MADV_FREE``: more faults), and purging off
with a purge after each step (as fast as glibc but a higher peak, 8.6 GB).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import sys
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc's malloc.h
#: ``trainer.malloc: auto`` gives an fp32 CPU trainer glibc's faster heap on machines with at least this much memory
#: (GiB; the machine's, or its memory cgroup's limit if lower), jemalloc's leaner one below: the fp32 demo's
#: processes together held 7.7 GiB of anonymous memory with the trainer on jemalloc, 9.8 on glibc (AVX2 EPYC), so a
#: 16 GB laptop (~15 GiB usable) and an 8 GiB box run it on jemalloc, a 24 GB machine on glibc
FAST_HEAP_MIN_GIB = 16.0
MAX_TRIM = 2**31 - 1  # mallopt takes an int
MAX_THRESHOLD = 32 * 2**20  # glibc refuses thresholds above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit)


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: mallopt's parameter numbers are glibc's
    except (OSError, AttributeError):
        return None
    return libc


def set_mmap_threshold(kib: int) -> bool:
    """Fix this process's mmap threshold at ``kib`` KiB (blocks this large or larger are mapped and unmapped on
    free). ``0`` leaves glibc's default (dynamic) threshold. Returns whether a threshold was set."""
    if kib <= 0:
        return False
    if kib * 1024 > MAX_THRESHOLD:
        raise ValueError(f"mmap threshold {kib} KiB is above glibc's limit of {MAX_THRESHOLD // 1024} KiB")
    libc = _libc()
    if libc is None:
        logger.debug("not glibc: the mmap threshold is left as is")
        return False
    if libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(kib * 1024)) != 1:
        logger.warning("mallopt(M_MMAP_THRESHOLD, %d KiB) failed: the heap keeps glibc's dynamic threshold", kib)
        return False
    # the free top of the heap is returned above twice the threshold (glibc's own rule while it is dynamic; a rise
    # before this call may have left it at up to 64 MiB)
    libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(2 * kib * 1024))
    return True


def never_map() -> bool:
    """Serve every block from the heap (no mappings: ``M_MMAP_MAX`` 0) and keep up to 2 GiB of its free top, so
    freed tensors are reused without page faults. Returns whether it was set (glibc only)."""
    libc = _libc()
    if libc is None:
        logger.debug("not glibc: the heap is left as is")
        return False
    if libc.mallopt(M_MMAP_MAX, ctypes.c_int(0)) != 1:
        logger.warning("mallopt(M_MMAP_MAX, 0) failed: large tensors keep their own mappings")
        return False
    libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(MAX_TRIM))
    return True


def jemalloc_path() -> Path | None:
    """The jemalloc shared library to preload: the one in Ray's wheel (a dependency, so present wherever agentrl is),
    else the system's (Debian's ``libjemalloc2``, which ``redis-server`` pulls in) by its bare name, which the
    dynamic loader finds where ``find_library`` did (ldconfig's cache); None if neither exists."""
    try:
        import ray

        bundled = Path(ray.__file__).parent / "core" / "libjemalloc.so"
        if bundled.is_file():
            return bundled
    except ImportError:
        pass
    name = ctypes.util.find_library("jemalloc")
    return Path(name) if name else None


def _why_not_jemalloc() -> tuple[str, str] | None:
    """Why jemalloc cannot be preloaded here, as (the fact, what to do), or None if it can."""
    if not sys.platform.startswith("linux"):
        return (f"it is preloaded with LD_PRELOAD, which only Linux's loader reads (this is {sys.platform})",
                "set trainer.malloc=glibc")
    path = jemalloc_path()
    if path is None:
        return ("no jemalloc library found (expected ray/core/libjemalloc.so in Ray's wheel or the system's "
                "libjemalloc.so.2)", "install libjemalloc2, or set trainer.malloc=glibc")
    bad = sorted({c for c in str(path) if c.isspace() or c in ":$"})
    if bad:
        return (f"the library's path {str(path)!r} holds {bad!r}, which LD_PRELOAD cannot carry (the loader splits "
                "on spaces and colons)", "install agentrl in a folder without them, or set trainer.malloc=glibc")
    return None


def preload_env(malloc: Literal["glibc", "jemalloc"]) -> dict[str, str]:
    """The environment a process must start with to allocate with ``malloc`` (empty for glibc): ``LD_PRELOAD`` of
    the jemalloc library alone (Ray does not pass the controller's own ``LD_PRELOAD`` to its workers either, and a
    second allocator preloaded beside it would split the process's heap between two). Raises ValueError where
    that cannot work, checked before any process starts: no library, a path the loader would split (it takes
    spaces and colons as separators, with no escape; Ray expands ``$`` in its env vars), not Linux."""
    if malloc == "glibc":
        return {}
    if malloc != "jemalloc":
        raise ValueError(f"trainer.malloc: expected glibc or jemalloc, got {malloc!r}")
    why = _why_not_jemalloc()
    if why is not None:
        raise ValueError(f"trainer.malloc=jemalloc: {why[0]}: {why[1]}")
    return {"LD_PRELOAD": str(jemalloc_path())}


def choose(malloc: Literal["auto", "glibc", "jemalloc"], mmap_threshold_kb: int | str, *, separate_process: bool,
           cpu: bool = True, dtype: str | None = None, lora: bool = False,
           memory_bytes: int | None = None) -> tuple[Literal["glibc", "jemalloc"], str]:
    """The allocator the trainer ranks start with, and why. ``auto`` takes jemalloc where it can be preloaded and
    was measured to pay: CPU trainers (a GPU trainer's tensors are not malloc's) in processes of their own (Ray
    mode; debug mode runs the trainer in the controller's process, already started), the library found and
    loadable by path, ``mmap_threshold_kb`` left at ``never`` (a number asks to shape glibc's heap), and not an fp32
    full fine-tuning trainer (``dtype``, resolved; ``lora`` False: a LoRA run is there to save memory, and on glibc
    its trainer's peak was 0.53-0.57 of full fine-tuning's, on jemalloc 0.33) on a machine with
    :data:`FAST_HEAP_MIN_GIB` of memory or more (``memory_bytes``; None: :func:`memory_limit_bytes`), where glibc's
    heap levels off and is the faster; else the system's allocator ("glibc"). ``glibc`` and ``jemalloc`` are taken
    as given (:func:`preload_env` refuses a jemalloc that cannot work)."""
    if malloc != "auto":
        return malloc, "trainer.malloc"
    if not separate_process:
        return "glibc", "debug mode runs the trainer in this process, already started on the system's allocator"
    if not cpu:
        return "glibc", "a GPU trainer: its tensors are not malloc's, and jemalloc was measured on CPU trainers only"
    if mmap_threshold_kb != "never":
        return "glibc", f"trainer.mmap_threshold_kb {mmap_threshold_kb} shapes glibc's heap"
    fast_heap_candidate = dtype == "fp32" and not lora
    memory = memory_limit_bytes() if memory_bytes is None and fast_heap_candidate else memory_bytes
    gib = math.floor(memory / 2**30 * 10) / 10 if memory is not None else None  # down: "16.0" is never under 16
    if fast_heap_candidate and memory is not None and memory >= FAST_HEAP_MIN_GIB * 2**30:
        return "glibc", (f"an fp32 trainer and {gib:.1f} GiB of memory: glibc's heap levels off in fp32 and spares "
                         f"jemalloc's page faults; below {FAST_HEAP_MIN_GIB:g} GiB jemalloc's leaner heap is chosen")
    why = _why_not_jemalloc()
    if why is not None:
        return "glibc", f"jemalloc cannot be preloaded: {why[0]}"
    if lora:
        return "jemalloc", "a LoRA trainer: the leaner heap (LoRA is there to save memory)"
    if dtype == "fp32":
        return "jemalloc", (f"an fp32 trainer and {gib:.1f} GiB of memory, under {FAST_HEAP_MIN_GIB:g}: the "
                            "leaner heap" if gib is not None else "the machine's memory is unknown: the leaner heap")
    return "jemalloc", (f"a {dtype} trainer: glibc's heap holds more and was no faster in the demo"
                        if dtype == "bf16" else "auto")


def memory_limit_bytes(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/proc/self/cgroup"),
                       root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The memory this process may use: the machine's (``MemTotal``), or the limit of a memory cgroup it runs in
    (v2 ``memory.max``, v1 ``memory.limit_in_bytes``, its own group's and its ancestors') if lower; None if
    ``meminfo`` cannot be read. This machine's: on a cluster the trainer ranks may run on another node (set
    ``trainer.malloc`` there), and the line does not scale with the model (measured on a 135M one)."""
    try:
        total = next(int(line.split()[1]) * 1024 for line in meminfo.read_text().splitlines()
                     if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError, IndexError):  # UnicodeDecodeError is a ValueError
        return None
    limits = [total]
    try:
        lines = cgroup.read_text().splitlines()
    except (OSError, ValueError):
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2's unified hierarchy
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        group = Path(path.lstrip("/"))
        for level in [group, *group.parents]:
            try:  # v2 says "max" where there is none; v1 a number near 2**63
                limits.append(int((base / level / name).read_text().strip()))
            except (OSError, ValueError):
                continue
    return min(limits)


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def jemalloc_loaded() -> bool:
    """Whether jemalloc serves this process's ``malloc``: the library the process's ``malloc`` symbol resolves to
    (a library merely mapped, e.g. linked privately into an extension, serves nothing)."""
    try:
        process = ctypes.CDLL(None)
        info = _DlInfo()
        if not process.dladdr(ctypes.cast(process.malloc, ctypes.c_void_p), ctypes.byref(info)):
            return False
    except (OSError, AttributeError):
        return False
    return b"jemalloc" in (info.dli_fname or b"")


def configure(setting: int | str, malloc: Literal["auto", "glibc", "jemalloc"] = "glibc") -> bool:
    """``trainer.mmap_threshold_kb``: ``"never"`` (:func:`never_map`), or a threshold in KiB
    (:func:`set_mmap_threshold`; 0 leaves glibc's default). Under jemalloc (``trainer.malloc``) glibc's heap serves
    nothing and nothing is set; a process that asked for jemalloc and does not have it is told so."""
    if jemalloc_loaded():
        logger.info("jemalloc serves this process's heap: trainer.mmap_threshold_kb does not apply")
        return False
    if malloc == "jemalloc":
        logger.warning("trainer.malloc=jemalloc, but this process was started without it (debug mode runs the "
                       "trainer in the controller's process; or the library is missing on this node): glibc's "
                       "heap serves it, with trainer.mmap_threshold_kb=%s", setting)
    if setting == "never":
        return never_map()
    return set_mmap_threshold(int(setting))
