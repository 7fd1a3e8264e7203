"""agentrl.heap: a fixed mmap threshold maps large blocks that glibc's rising default would carve from the heap."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from agentrl.heap import set_mmap_threshold

PROBE = textwrap.dedent(
    """
    import ctypes, sys
    from agentrl.heap import set_mmap_threshold
    libc = ctypes.CDLL("libc.so.6")
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in names]
    libc.mallinfo2.restype = Info
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def mapped(size):  # whether a block of `size` bytes gets its own mapping
        before = libc.mallinfo2().hblks
        p = libc.malloc(size)
        got = libc.mallinfo2().hblks - before
        libc.free(p)
        return got

    from agentrl.heap import configure
    fixed = configure(sys.argv[1] if sys.argv[1] == "never" else int(sys.argv[1]))
    libc.free(libc.malloc(20 << 20))  # a 20 MiB mapped block freed: glibc's default raises its threshold to 20 MiB
    print(fixed, mapped(2 << 20), mapped(512 << 10), mapped(256 << 20))
    """
)


def _probe(kib: int | str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(kib)], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.split()


def test_fixed_threshold_maps_what_the_rising_default_keeps_in_the_heap() -> None:
    # glibc's default: after a large block is freed, a 2 MiB tensor comes from the heap (and fragments it)
    assert _probe(0) == ["False", "0", "0", "1"]  # above glibc's 32 MiB ceiling a block is always mapped
    assert _probe(1024) == ["True", "1", "0", "1"]  # fixed at 1 MiB: 2 MiB mapped, 512 KiB from the heap


def test_never_map_serves_every_block_from_the_heap() -> None:
    """The trainer's default: even a 256 MiB block comes from the heap, so freeing it keeps its pages for reuse."""
    assert _probe("never") == ["True", "0", "0", "0"]


def test_the_trainer_setting_accepts_never_or_a_threshold() -> None:
    from pydantic import ValidationError

    from agentrl.trainer import TrainerConfig

    assert TrainerConfig(model="m").mmap_threshold_kb == "never"
    assert TrainerConfig(model="m", mmap_threshold_kb=1024).mmap_threshold_kb == 1024
    for bad in ("nevr", -1, 65536):
        with pytest.raises(ValidationError, match="mmap_threshold_kb"):
            TrainerConfig(model="m", mmap_threshold_kb=bad)


def test_threshold_above_glibc_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="above glibc's limit of 32768 KiB"):
        set_mmap_threshold(65536)
