"""benchmarks/time_to_accuracy.py: the command it runs and its last line, also when 0.9 was never reached (the
real run: `benchmarks/time_to_accuracy.py --quick`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _common  # noqa: E402
import time_to_accuracy  # noqa: E402


def test_the_demo_runs_in_the_run_directory_with_the_overrides_last(tmp_path: Path) -> None:
    cmd = time_to_accuracy.command(tmp_path / "tta", ["seed=1", "data.heldout_every=2"], quick=True)
    assert cmd[1:5] == ["-m", "agentrl.cli", "demo", "--smoke"]
    assert f"runs_dir={tmp_path}" in cmd and "name=tta" in cmd and "data.num_heldout=4" in cmd
    assert cmd[-2:] == ["seed=1", "data.heldout_every=2"]  # after the quick defaults: they win
    assert "--smoke" not in time_to_accuracy.command(tmp_path / "tta", [], quick=False)
    lora = time_to_accuracy.command(tmp_path / "tta", ["seed=1"], quick=False, lora=True)
    assert lora[3:5] == ["demo", "--lora"] and lora[-1] == "seed=1"


def test_the_settings_name_the_lora_rank_and_the_precisions(tmp_path: Path) -> None:
    from agentrl.launcher import recipes
    from agentrl.launcher.config import load_config, save_config

    for base, want in ((recipes.DEMO, "none"), (recipes.DEMO_LORA, "r16")):
        save_config(load_config(None, ["engine.dtype=float32", "trainer.dtype=fp32"], base=base),
                    tmp_path / "config.yaml")
        got = time_to_accuracy.run_settings(tmp_path)
        assert got == {"heldout_every": 5, "lora": want, "dtype": "engine:float32,trainer:fp32"}
    (tmp_path / "config.yaml").write_text("trainer: [")  # unreadable: said, not raised after a long run
    assert time_to_accuracy.run_settings(tmp_path)["lora"] == "unknown"


def test_the_last_line_says_none_when_never_reached() -> None:
    summary = {"time_to_heldout_0.9_s": None, "time_to_heldout_0.9_rl_s": None, "heldout_accuracy_sft": 0.75,
               "heldout_accuracy_after": 0.85, "wall_time_s": 2400.5, "steps": 30,
               "heldout_curve": [{"label": "sft"}, {"label": "v5"}, {"label": "after"}]}
    line = _common.last_line(time_to_accuracy.figures(summary, 2500.0), {"cpu": "x"})
    got = dict(kv.split("=", 1) for kv in line.split())
    assert got["time_to_heldout_0.9_s"] == "none" and got["time_to_heldout_0.9_rl_s"] == "none"
    assert got["heldout_sft"] == "0.750" and got["heldout_after"] == "0.850" and got["wall_s"] == "2500"
    assert got["heldout_evals"] == "3" and got["cpu"] == "x"
    assert got["peak_rss_gb"] == got["peak_anon_gb"] == "none"  # a summary without a memory block
    memory = {"peak_concurrent_gb": 13.4, "peak_concurrent_anon_gb": 10.25}
    assert {k: v for k, v in time_to_accuracy.figures({**summary, "memory": memory}, 1.0).items()
            if k.startswith("peak_")} == {"peak_rss_gb": 13.4, "peak_anon_gb": 10.25}
    reached = time_to_accuracy.figures({**summary, "time_to_heldout_0.9_s": 1234.5,
                                        "time_to_heldout_0.9_rl_s": 600.25}, 2500.0)
    assert (reached["time_to_heldout_0.9_s"], reached["time_to_heldout_0.9_rl_s"]) == (1234.5, 600.25)


def _memory_cgroups() -> bool:
    from agentrl.sandbox._cgroup import CgroupTree

    tree = CgroupTree.detect()
    return tree is not None and "memory" in tree.parents


HOLD = "import time; b = bytearray({mb} << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.0)"


@pytest.mark.skipif(not _memory_cgroups(), reason="needs a writable cgroup v1 memory controller")
def test_the_memory_limit_holds_the_whole_tree_and_reports_its_peak_and_kills() -> None:
    # Within the limit: a grandchild's 300 MB counts (the tree is inside), and the cgroup is gone afterwards.
    child = f"import subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', {HOLD.format(mb=300)!r}]).returncode)"
    limit = time_to_accuracy.MemoryLimit(1.0, interval_s=0.1)
    with limit:
        ok = subprocess.run([sys.executable, "-c", child], preexec_fn=limit.enter, timeout=60)
    assert ok.returncode == 0 and limit.result["oom_kills"] == 0
    assert 0.29 < limit.result["cgroup_anon_peak_gb"] < 1.0 and limit.result["cgroup_peak_gb"] <= 1.0
    assert not limit.dir.exists()
    # Beyond it: the kernel kills the process, and the figures say so.
    limit = time_to_accuracy.MemoryLimit(0.25, interval_s=0.1)
    with limit:
        killed = subprocess.run([sys.executable, "-c", HOLD.format(mb=400)], preexec_fn=limit.enter, timeout=60)
    assert killed.returncode == -9 and limit.result["oom_kills"] >= 1
    assert limit.result["cgroup_peak_gb"] <= 0.25
