"""benchmarks/_common.py: the interleaving order, the ratio arithmetic and the last line's format."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _common  # noqa: E402


def test_interleaved_alternates_after_a_warmup_and_takes_the_median_of_round_ratios() -> None:
    calls: list[str] = []
    base_rates = iter([99.0, 10.0, 10.0, 20.0, 10.0])  # the first is the warm-up's: never in a ratio
    ours_rates = iter([1.0, 12.0, 10.0, 10.0, 30.0])

    def base() -> float:
        calls.append("b")
        return next(base_rates)

    def ours() -> float:
        calls.append("o")
        return next(ours_rates)

    c = _common.interleaved(4, base, ours)
    assert calls == ["b", "o", "b", "o", "o", "b", "b", "o", "o", "b"]
    assert c.ratios == [1.2, 1.0, 0.5, 3.0]
    assert c.median == pytest.approx(1.1)
    assert c.range == (0.5, 3.0) and c.parity
    assert c.fields("x") == {"x": c.median, "x_range": (0.5, 3.0), "rounds": 4}


def test_ainterleaved_uses_the_given_warmup_and_a_rate_function() -> None:
    calls: list[str] = []

    async def warm() -> None:
        calls.append("w")

    async def base() -> float:
        calls.append("b")
        return 2.0  # seconds

    async def ours() -> float:
        calls.append("o")
        return 1.0

    c = asyncio.run(_common.ainterleaved(3, base, ours, rate=lambda s: 1 / s, warmup=warm))
    assert calls == ["w", "b", "o", "o", "b", "b", "o"]
    assert c.ratios == [2.0, 2.0, 2.0] and not c.parity


def test_rounds_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="expected at least 1"):
        _common.interleaved(0, lambda: 1.0, lambda: 1.0)


def test_last_line_formats_by_size_and_reads_back() -> None:
    line = _common.last_line({"ratio": 0.98612, "ratio_range": (0.9512, 1.1), "tps": 56.78, "n": 3,
                              "big": 2802.4, "small": 0.04312, "nan": float("nan")},
                             {"cpu": "Intel Xeon", "commit": "abc1234-dirty"})
    assert line.startswith("ratio=0.986 ratio_range=0.951-1.100 tps=56.8 n=3 big=2802 small=0.0431 nan=nan "
                           "cpu=Intel_Xeon commit=abc1234-dirty load1_end=")
    assert dict(kv.split("=", 1) for kv in line.split())["cpu"] == "Intel_Xeon"


@pytest.mark.parametrize(("model", "short"), [
    ("Intel(R) Xeon(R) Platinum 8488C", "Intel_Xeon_Platinum_8488C"),
    ("AMD EPYC 9R14 96-Core Processor", "AMD_EPYC_9R14"),
    ("Intel(R) Xeon(R) CPU @ 2.20GHz", "Intel_Xeon"),
    ("", "unknown"),
])
def test_short_cpu(model: str, short: str) -> None:
    assert _common.short_cpu(model) == short


def test_environment_names_this_machine() -> None:
    env = _common.environment(dtype="fp32", packages=("pytest", "no-such-distribution"))
    assert env["cores"] >= 1 and env["nproc"] >= env["cores"]
    assert env["dtype"] == "fp32" and env["no-such-distribution"] == "absent"
    assert env["pytest"] == pytest.__version__
    assert env["commit"] != "unknown"  # the tests run in a git checkout
    assert len(_common.last_line({}, env).split()) == len(env) + 1  # one name=value per field, then load1_end


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_start_pinned_puts_every_server_on_the_first_cpu_and_the_client_on_the_others() -> None:
    from agentrl.launcher.cores import pin_to_cores

    cpus = sorted(os.sched_getaffinity(0))
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        procs.append(subprocess.Popen(["sleep", "30"]))
        return procs[-1]

    try:
        started, where = asyncio.run(_common.start_pinned(start, start))
        assert started == procs and len(procs) == 2
        assert [os.sched_getaffinity(p.pid) for p in procs] == [{cpus[0]}, {cpus[0]}]  # the second too
        assert os.sched_getaffinity(0) == set(cpus[1:])
        assert where == f"server:{cpus[0]},client:{','.join(map(str, cpus[1:]))}"
    finally:
        pin_to_cores(cpus)
        for p in procs:
            p.kill()
            p.wait(10)


def test_rss_sampler_sees_a_transient_allocation_inside_its_phase_only(tmp_path: Path) -> None:
    """In a fresh process: this one's heap may be shaped by a Trainer an earlier test built (agentrl.heap keeps
    freed memory and maps no large block), which would hide the spike."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(Path(_common.__file__).parent)!r})\n"
        "import torch, _common\n"
        "sampler = _common.RssSampler(interval_s=0.001)\n"
        "with sampler.phase('quiet'):\n"
        "    time.sleep(0.05)\n"
        "base = sampler.rss()\n"
        "with sampler.phase('spike'):\n"
        "    t = torch.ones(40_000_000)  # 160 MB, touched\n"
        "    time.sleep(0.05)  # held a while: the sampler thread sees it, not only the phase's end\n"
        "    del t\n"
        "after = sampler.rss()\n"
        "sampler.close()\n"
        "print(sampler.peaks['quiet'] - base, sampler.peaks['spike'] - base, after - base)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    quiet, spike, after = map(int, out.stdout.split())
    assert spike > 150e6  # the peak inside the phase, though the tensor was freed before it ended
    assert quiet < 50e6 and after < 50e6  # not before, and gone after (glibc returns a mapping this large at once)


def test_reexec_with_live_memory_restarts_under_jemalloc_returning_pages_at_once(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(_common.__file__).parent)!r})\n"
        "import _common\n"
        "print('before', _common.live_memory_process(), flush=True)\n"
        "_common.reexec_with_live_memory()\n"
        "print('after', _common.live_memory_process())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF", "AGENTRL_LIVE_MEMORY_REEXEC")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["before", "False", "before", "True", "after", "True"]
