"""Memory accounting (agentrl/launcher/memory.py): real processes that allocate a known amount, sampled for real;
the controller's combination of the nodes' reports as pure logic."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from agentrl.launcher.memory import GIB, MemorySampler, combine, read_memory, report_line

MIB = 2**20
ALLOC_MB = 300
# allocates (and touches: bytes * n writes every page) ALLOC_MB, says so, then waits for stdin to close; with
# FREE, frees it first and says "freed" (its RSS drops, its VmHWM stays)
CHILD = ("import sys\nb = bytearray(b'\\x01') * ({mb} * 2**20)\nprint('ready', flush=True)\n"
         "if {free}:\n    del b\n    print('freed', flush=True)\nsys.stdin.read()\n")
# a parent that runs the child with its own stdin/stdout: the child is a grandchild of the test
PARENT = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', {child!r}])\n"


def _start(free: bool = False, via_parent: bool = True) -> subprocess.Popen[str]:
    child = CHILD.format(mb=ALLOC_MB, free=free)
    code = PARENT.format(child=child) if via_parent else child
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _wait_for(proc: subprocess.Popen[str], word: str) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line == word, f"the allocating child said {line!r}, expected {word!r}"


def _grandchild(proc: subprocess.Popen[str]) -> int:
    import psutil

    (child,) = psutil.Process(proc.pid).children()
    return child.pid


def _end(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=30)


def test_a_tree_watch_counts_the_children_it_started():
    proc = _start()
    try:
        _wait_for(proc, "ready")
        sampler = MemorySampler()
        sampler.watch("tree", proc.pid, tree=True)
        summed = sampler.sample()
        report = sampler.report()
    finally:
        _end(proc)
    assert summed >= ALLOC_MB * MIB, "the concurrent sum must include the grandchild's allocation"
    assert report["peaks"]["tree"] >= ALLOC_MB * MIB
    assert report["processes"] == 2 and max(v for _, v in report["series"]) == summed
    assert ALLOC_MB * MIB <= max(v for _, v in report["anon_series"]) < summed  # the allocation is anonymous
    # the same pass per role: the tree's anonymous memory is all of it
    assert [(t, roles["tree"]) for t, roles in report["anon_roles"]] == report["anon_series"]


def test_a_mapped_file_is_resident_but_not_anonymous(tmp_path):
    """Pages backed by a file (libraries, model files) count in RSS once per process; RssAnon leaves them out."""
    path = tmp_path / "mapped.bin"
    path.write_bytes(b"\x01" * (ALLOC_MB * MIB))
    code = ("import mmap, sys\nf = open(sys.argv[1], 'rb')\nm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n"
            "sum(m[i] for i in range(0, len(m), 4096))\nprint('ready', flush=True)\nsys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        _wait_for(proc, "ready")
        sampler = MemorySampler()
        sampler.watch("child", proc.pid)
        summed = sampler.sample()
        memory = read_memory(proc.pid)
        report = sampler.report()
    finally:
        _end(proc)
    assert memory is not None and memory.rss >= ALLOC_MB * MIB and memory.anon < ALLOC_MB * MIB / 2
    assert summed >= ALLOC_MB * MIB and max(v for _, v in report["anon_series"]) < ALLOC_MB * MIB / 2


def test_a_watch_without_tree_leaves_the_children_out():
    proc = _start()
    try:
        _wait_for(proc, "ready")
        sampler = MemorySampler()
        sampler.watch("parent", proc.pid)
        summed = sampler.sample()
    finally:
        _end(proc)
    assert 0 < summed < ALLOC_MB * MIB / 2


def test_the_peak_survives_a_free_between_samples():
    """VmHWM is the kernel's peak: the per-process figure sees an allocation no sample saw; the concurrent one
    does not (it is what was resident when sampled)."""
    proc = _start(free=True, via_parent=False)
    try:
        _wait_for(proc, "ready")
        _wait_for(proc, "freed")
        sampler = MemorySampler()
        sampler.watch("child", proc.pid)
        summed = sampler.sample()
        report = sampler.report()
    finally:
        _end(proc)
    assert report["peaks"]["child"] >= ALLOC_MB * MIB
    assert summed < ALLOC_MB * MIB / 2


def test_each_process_is_counted_once_by_the_first_watch_and_skipped_subtrees_by_none():
    proc = _start()
    try:
        _wait_for(proc, "ready")
        grandchild = _grandchild(proc)
        claimed = MemorySampler()
        claimed.watch("grandchild", grandchild)
        claimed.watch("tree", proc.pid, tree=True)
        claimed_sum = claimed.sample()
        skipped = MemorySampler()
        skipped.skip(lambda: {grandchild})
        skipped.watch("tree", proc.pid, tree=True)
        skipped_sum = skipped.sample()
    finally:
        _end(proc)
    peaks = claimed.report()["peaks"]
    assert peaks["grandchild"] >= ALLOC_MB * MIB and peaks["tree"] < ALLOC_MB * MIB / 2
    assert claimed_sum >= ALLOC_MB * MIB
    assert skipped_sum < ALLOC_MB * MIB / 2 and skipped.report()["processes"] == 1


def test_the_thread_samples_until_stopped_and_a_gone_process_is_no_error():
    proc = _start(via_parent=False)
    try:
        _wait_for(proc, "ready")
        sampler = MemorySampler(interval_s=0.05)
        sampler.watch("child", proc.pid)
        sampler.watch("later", lambda: None)  # not running (yet): skipped
        sampler.start()
        deadline = time.monotonic() + 10
        while len(sampler.report()["series"]) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        _end(proc)
    sampler.stop()  # its last pass finds the child gone
    report = sampler.report()
    assert report["peaks"] == {"child": report["peaks"]["child"]} and report["peaks"]["child"] >= ALLOC_MB * MIB
    assert read_memory(proc.pid) is None
    assert report["total_ram"] > 0 and report["host"]


def test_a_bad_interval_is_refused():
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        MemorySampler(interval_s=0)


def _report(host: str, peaks: dict[str, int], series: list[tuple[int, int]]) -> dict:
    """A node's report whose anonymous memory is half its RSS, all of it its first role's."""
    role = next(iter(peaks))
    return {"host": host, "total_ram": 8 * GIB, "interval_s": 1.0, "peaks": peaks, "processes": len(peaks),
            "series": series, "anon_series": [(t, v // 2) for t, v in series],
            "anon_roles": [(t, {role: v // 2}) for t, v in series]}


def test_combine_sums_the_sides_second_by_second():
    driver = _report("a", {"driver": 1 * GIB, "redis": GIB // 2}, [(100, 1 * GIB), (101, 1 * GIB), (102, GIB)])
    rollout = _report("a", {"rollout": GIB, "sglang": 3 * GIB}, [(100, 2 * GIB), (101, 4 * GIB)])
    # the trainer's one sample at 102 meets the rollout's of 101 (one interval old); the driver's 1 GB each time
    trainer = _report("b", {"trainer-0": 2 * GIB}, [(102, 2 * GIB), (110, 5 * GIB)])
    memory = combine([driver, None, rollout, trainer], total_ram=24 * GIB)
    assert memory["peak_concurrent_gb"] == 7.0  # 1 + 4 + 2 at second 102
    assert memory["peak_concurrent_anon_gb"] == 3.5  # the same seconds, half of each
    # who held it then: the rollout's sample of 101, the others' of 102; two seconds after the first sample (100)
    assert memory["peak_anon_by_role"] == {"driver": 0.5, "rollout": 2.0, "trainer-0": 1.0}
    assert memory["peak_anon_at_s"] == 2
    assert memory["per_process"] == {"driver": 1.0, "redis": 0.5, "rollout": 1.0, "sglang": 3.0, "trainer-0": 2.0}
    assert memory["sum_of_peaks_gb"] == sum(memory["per_process"].values()) == 7.5
    assert memory["processes"] == 5 and memory["hosts"] == ["a", "b"] and memory["total_ram_gb"] == 24.0
    # at 110 the others' last samples are 8-9 s old: they had stopped; 5 GB alone is less than 7
    late = _report("b", {"trainer-0": 2 * GIB}, [(110, 8 * GIB)])
    assert combine([driver, rollout, late], total_ram=GIB)["peak_concurrent_gb"] == 8.0
    assert combine([driver, rollout, late], total_ram=GIB)["peak_anon_by_role"] == {"trainer-0": 4.0}


def test_combine_of_nothing_and_the_report_line():
    empty = combine([None], total_ram=GIB)
    assert empty["peak_concurrent_gb"] == 0 and empty["per_process"] == {} and empty["processes"] == 0
    assert empty["peak_concurrent_anon_gb"] == 0 and empty["peak_anon_by_role"] == {}
    assert empty["peak_anon_at_s"] is None
    line = report_line({"peak_concurrent_gb": 5.5, "peak_concurrent_anon_gb": 4.25, "sum_of_peaks_gb": 6.25,
                        "processes": 12, "total_ram_gb": 24.0,
                        "per_process": {"trainer-0": 2.5, "sglang": 1.5, "sglang-1": 1.0, "driver": 0.5}})
    assert line.startswith("peak memory: 5.50 GB concurrent (4.25 GB of it anonymous, sum of peaks 6.25 GB) over 12 processes seen in the run (short-lived ones included); "
                           "trainer rank 0 2.50 GB; SGLang 2.50 GB")
    with_roles = report_line({"peak_concurrent_gb": 5.5, "peak_concurrent_anon_gb": 4.25, "sum_of_peaks_gb": 6.25,
                              "processes": 12, "total_ram_gb": 24.0, "per_process": {"trainer-0": 2.5},
                              "peak_anon_by_role": {"sglang": 1.25, "trainer-0": 3.0}, "peak_anon_at_s": 812})
    assert "; anonymous at its peak (812 s in): trainer-0 3.00, sglang 1.25 GB (GB = 2^30" in with_roles
