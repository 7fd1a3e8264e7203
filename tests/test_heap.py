"""agentrl.heap: a fixed mmap threshold maps large blocks that glibc's rising default would carve from the heap."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

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


JEMALLOC_PROBE = textwrap.dedent(
    """
    import logging, sys
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch
    from agentrl import heap
    x = torch.ones(64 * 2**20 // 4); del x  # a large tensor allocated and freed by whichever malloc is loaded
    print(heap.jemalloc_loaded(), heap.configure("never", sys.argv[1]))
    """
)


def _probe_with(env: dict[str, str], malloc: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-c", JEMALLOC_PROBE, malloc], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)


def test_jemalloc_preloaded_serves_the_process_and_glibc_settings_are_skipped():
    from agentrl.heap import preload_env

    env = preload_env("jemalloc")  # Ray's wheel ships the library: always found in the test environment
    assert "jemalloc" in env["LD_PRELOAD"] and ":" not in env["LD_PRELOAD"]
    done = _probe_with(env, "jemalloc")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False"]  # malloc is jemalloc's; no mallopt applied
    assert "jemalloc serves this process's heap" in done.stderr
    assert preload_env("glibc") == {}


def test_jemalloc_loaded_privately_serves_nothing():
    """A jemalloc mapped into the process without interposing (``dlopen`` is ``RTLD_LOCAL``) is not its ``malloc``."""
    from agentrl.heap import jemalloc_path

    probe = ("import ctypes, sys; from agentrl import heap; before = heap.jemalloc_loaded(); "
             "ctypes.CDLL(sys.argv[1]); print(before, heap.jemalloc_loaded(), "
             "sys.argv[1] in open('/proc/self/maps').read())")
    import os

    # jemalloc's TLS is initial-exec: dlopen needs room for it in the static TLS block, which this tunable gives
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=65536"}
    done = subprocess.run([sys.executable, "-c", probe, str(jemalloc_path())], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False", "True"]  # mapped, yet glibc's malloc serves the process


def test_preload_env_carries_the_library_alone_and_refuses_paths_the_loader_would_split(monkeypatch, tmp_path):
    from agentrl import heap

    monkeypatch.setenv("LD_PRELOAD", "/opt/profiler/libprof.so")  # the controller's own: not the ranks' business
    assert heap.preload_env("jemalloc")["LD_PRELOAD"] == str(heap.jemalloc_path())
    for name in ("my libs", "a:b", "$HOME"):
        folder = tmp_path / name
        folder.mkdir()
        monkeypatch.setattr(heap, "jemalloc_path", lambda f=folder: f / "libjemalloc.so")
        with pytest.raises(ValueError, match="LD_PRELOAD cannot carry"):
            heap.preload_env("jemalloc")
    with pytest.raises(ValueError, match="expected glibc or jemalloc, got 'tcmalloc'"):
        heap.preload_env("tcmalloc")  # type: ignore[arg-type]


def test_asking_for_jemalloc_without_it_warns_and_keeps_glibc_settings():
    done = _probe_with({}, "jemalloc")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True"]  # glibc's heap, never_map applied
    assert "started without it" in done.stderr


def test_malloc_key_is_validated():
    from pydantic import ValidationError

    from agentrl.trainer.config import TrainerConfig, TrainerSettings

    assert TrainerConfig(model="m").malloc == "auto"
    assert TrainerConfig(model="m", mmap_threshold_kb=1024).malloc == "auto"  # auto then chooses glibc
    with pytest.raises(ValidationError, match="malloc"):
        TrainerConfig(model="m", malloc="tcmalloc")
    with pytest.raises(ValidationError, match="mmap_threshold_kb 1024 shapes glibc's heap"):
        TrainerConfig(model="m", malloc="jemalloc", mmap_threshold_kb=1024)
    assert TrainerSettings(malloc="jemalloc").for_model("n").malloc == "jemalloc"  # the run's settings carry over


def test_preflight_names_a_missing_jemalloc(monkeypatch):
    from agentrl import heap
    from agentrl.errors import ConfigError
    from agentrl.launcher.config import load_config
    from agentrl.launcher.preflight import check_run

    monkeypatch.setattr(heap, "jemalloc_path", lambda: None)
    cfg = load_config(None, ["trainer.malloc=jemalloc"])
    with pytest.raises(ConfigError, match="no jemalloc library found"):
        check_run(cfg)


def test_preflight_in_debug_mode_warns_instead_of_looking_for_the_library(monkeypatch, caplog):
    """Debug mode runs the trainer in the controller's process, started before any preload could be chosen."""
    from agentrl import heap
    from agentrl.launcher.config import load_config
    from agentrl.launcher.preflight import check_run

    monkeypatch.setattr(heap, "jemalloc_path", lambda: None)
    cfg = load_config(None, ["trainer.malloc=jemalloc", "resources.ray=false"])
    with caplog.at_level("WARNING", logger="agentrl.launcher.preflight"):
        check_run(cfg)
    assert "debug mode (ray: false) runs the trainer in this process" in caplog.text


def test_auto_chooses_jemalloc_only_where_it_can_be_preloaded(monkeypatch):
    from agentrl import heap

    assert heap.choose("auto", "never", separate_process=True) == ("jemalloc", "auto")
    malloc, why = heap.choose("auto", "never", separate_process=False)
    assert malloc == "glibc" and "debug mode" in why
    malloc, why = heap.choose("auto", 1024, separate_process=True)
    assert malloc == "glibc" and "mmap_threshold_kb 1024 shapes glibc's heap" in why
    assert heap.choose("glibc", "never", separate_process=True) == ("glibc", "trainer.malloc")
    assert heap.choose("jemalloc", "never", separate_process=True) == ("jemalloc", "trainer.malloc")
    malloc, why = heap.choose("auto", "never", separate_process=True, cpu=False)
    assert malloc == "glibc" and "GPU trainer" in why
    monkeypatch.setattr(heap, "jemalloc_path", lambda: None)
    malloc, why = heap.choose("auto", "never", separate_process=True)
    assert malloc == "glibc" and "no jemalloc library found" in why
    assert "set trainer.malloc" not in why  # the reason for a choice nobody made, not advice to make one


GIB = 2**30


def test_auto_gives_an_fp32_trainer_glibc_where_memory_allows_and_bf16_jemalloc(monkeypatch):
    """fp32: glibc's heap levels off and spares jemalloc's page faults (1.3x the step on an AVX2 EPYC), so auto
    takes it on machines with FAST_HEAP_MIN_GIB or more; bf16 (glibc fragments) and smaller machines: jemalloc."""
    from agentrl import heap

    floor = int(heap.FAST_HEAP_MIN_GIB * GIB)
    malloc, why = heap.choose("auto", "never", separate_process=True, dtype="fp32", memory_bytes=floor)
    assert malloc == "glibc" and why.startswith("an fp32 trainer and 16.0 GiB of memory: glibc's heap levels off")
    malloc, why = heap.choose("auto", "never", separate_process=True, dtype="fp32", memory_bytes=floor - 1)
    assert malloc == "jemalloc" and why.startswith("an fp32 trainer and 15.9 GiB of memory, under 16")
    malloc, why = heap.choose("auto", "never", separate_process=True, dtype="bf16", memory_bytes=64 * GIB)
    assert malloc == "jemalloc" and "bf16 trainer" in why
    malloc, why = heap.choose("auto", "never", separate_process=True, dtype="fp32", lora=True, memory_bytes=64 * GIB)
    assert malloc == "jemalloc" and "LoRA trainer" in why
    assert heap.choose("jemalloc", "never", separate_process=True, dtype="fp32", memory_bytes=64 * GIB) == (
        "jemalloc", "trainer.malloc")  # an explicit choice stands
    malloc, why = heap.choose("auto", "never", separate_process=True, cpu=False, dtype="fp32", memory_bytes=64 * GIB)
    assert malloc == "glibc" and "GPU trainer" in why
    monkeypatch.setattr(heap, "memory_limit_bytes", lambda: None)  # unreadable: the leaner heap
    malloc, why = heap.choose("auto", "never", separate_process=True, dtype="fp32")
    assert malloc == "jemalloc" and "memory is unknown" in why
    monkeypatch.setattr(heap, "memory_limit_bytes", lambda: 32 * GIB)  # read from the machine when not given
    assert heap.choose("auto", "never", separate_process=True, dtype="fp32")[0] == "glibc"


def _machine(tmp_path: Path, total_kib: int, cgroup: str, files: dict[str, str]) -> dict[str, Path]:
    tmp_path.mkdir(parents=True)
    (tmp_path / "meminfo").write_text(f"MemTotal:       {total_kib} kB\nMemFree:        1 kB\n")
    (tmp_path / "cgroup").write_text(cgroup)
    for rel, text in files.items():
        (tmp_path / "fs" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / rel).write_text(text)
    return {"meminfo": tmp_path / "meminfo", "cgroup": tmp_path / "cgroup", "root": tmp_path / "fs"}


def test_memory_limit_is_the_machine_s_or_a_lower_cgroup_limit(tmp_path):
    from agentrl.heap import memory_limit_bytes

    total = 24 * GIB
    # cgroup v1: the run's group (as benchmarks/time_to_accuracy.py --memory-limit-gb makes) and an unlimited parent
    v1 = _machine(tmp_path / "v1", total // 1024, "9:memory:/agentrl/run\n5:cpu,cpuacct:/\n",
                  {"memory/agentrl/run/memory.limit_in_bytes": str(8 * GIB),
                   "memory/memory.limit_in_bytes": "9223372036854771712"})
    assert memory_limit_bytes(**v1) == 8 * GIB
    # cgroup v2: "max" at the leaf, a limit on an ancestor
    v2 = _machine(tmp_path / "v2", total // 1024, "0::/user.slice/job\n",
                  {"user.slice/job/memory.max": "max\n", "user.slice/memory.max": str(12 * GIB)})
    assert memory_limit_bytes(**v2) == 12 * GIB
    # a limit above the machine's memory, or no cgroup files: the machine's
    big = _machine(tmp_path / "big", total // 1024, "0::/\n", {"memory.max": str(64 * GIB)})
    assert memory_limit_bytes(**big) == total
    assert memory_limit_bytes(**_machine(tmp_path / "none", total // 1024, "garbage\n", {})) == total
    assert memory_limit_bytes(meminfo=tmp_path / "missing") is None
    assert 0 < (memory_limit_bytes() or 0) <= 2**63  # this machine's, read for real


def test_a_process_in_a_real_memory_cgroup_reads_its_limit(tmp_path):
    """As ``time_to_accuracy.py --memory-limit-gb 8`` runs the demo: the controller inside an 8 GiB memory cgroup
    sees 8 GiB, and auto gives its fp32 trainer jemalloc."""
    import asyncio

    from agentrl import heap
    from agentrl.sandbox._cgroup import CgroupTree

    tree = CgroupTree.detect()
    if tree is None or "memory" not in tree.controllers:
        pytest.skip("no writable memory cgroup here")
    if (heap.memory_limit_bytes() or 0) <= 8192 << 20:
        pytest.skip("this machine (or a cgroup above us) has 8 GiB or less already")
    group = CgroupTree({"memory": tree.parents["memory"]}).create()  # memory only, as time_to_accuracy.py does
    try:
        group.set_limits(memory_mb=8192, pids=0, cpus=0.0)  # pids, cpu: not in this cgroup
        code = ("from agentrl import heap; print(heap.memory_limit_bytes(), "
                "heap.choose('auto', 'never', separate_process=True, dtype='fp32')[0])")
        enter = " ".join(f"echo $$ > {f};" for f in group.procs_files)
        out = subprocess.run(["sh", "-c", f'{enter} exec "$0" -c "$1"', sys.executable, code], capture_output=True,
                             text=True, timeout=120, check=True).stdout.split()
    finally:
        asyncio.run(group.remove(timeout_s=10.0))
    assert out == [str(8192 << 20), "jemalloc"]


def test_preflight_with_auto_and_no_library_goes_on_with_glibc(monkeypatch, caplog):
    """``auto`` never stops a run or warns: without the library the ranks start on glibc (TrainerGroup.start logs
    why); in debug mode the preflight says which allocator the trainer in this process has."""
    from agentrl import heap
    from agentrl.launcher.config import load_config
    from agentrl.launcher.preflight import check_run

    monkeypatch.setattr(heap, "jemalloc_path", lambda: None)
    with caplog.at_level("INFO", logger="agentrl.launcher.preflight"):
        assert check_run(load_config(None, [])).is_dir()
        assert not caplog.records
        check_run(load_config(None, ["resources.ray=false"]))
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "trainer.malloc auto: glibc (debug mode runs the trainer in this process, already started on the "
                 "system's allocator)")]
