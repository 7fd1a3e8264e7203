"""benchmarks/trainer_memory.py: the demo-shaped steps it replays differ from step to step (what fragments a heap)
and are the same sequence for every configuration; `--quick` runs both configurations to its last line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
from trainer_memory import demo_step  # noqa: E402


def test_steps_have_the_demo_shape_and_change_from_step_to_step() -> None:
    a, b = demo_step(0, 6, 8), demo_step(1, 6, 8)
    assert len(a) == len(b) == 48
    assert [list(t.token_ids) for t in a] == [list(t.token_ids) for t in demo_step(0, 6, 8)]  # the same for every configuration
    assert sorted(t.num_tokens for t in a) != sorted(t.num_tokens for t in b)
    for t in a:
        assert len(t.loss_mask) == len(t.token_ids) == len(t.behavior_logprobs) and t.loss_mask[t.prompt_len - 1] == 0
        assert t.loss_mask[t.prompt_len] == 1 and t.loss_mask[-1] == 1
    groups = {t.group_id for t in a}
    assert len(groups) == 6
    for g in groups:  # a group's responses continue one prompt (what the shared_prefix layout runs once)
        prompts = {tuple(t.token_ids[: t.prompt_len]) for t in a if t.group_id == g}
        assert len(prompts) == 1
    assert any(0 in list(t.loss_mask[t.prompt_len :]) for t in a)  # some episodes have an interpreter turn


def test_quick_run_reports_both_thresholds() -> None:
    out = subprocess.run([sys.executable, str(BENCH / "trainer_memory.py"), "--quick"], capture_output=True,
                         text=True, timeout=600, cwd=BENCH)
    assert out.returncode == 0, out.stderr[-3000:]
    last = dict(kv.split("=", 1) for kv in out.stdout.strip().splitlines()[-1].split())
    for kib in ("1024", "never"):
        assert float(last[f"peak_rss_gb_{kib}"]) >= float(last[f"first_step_rss_gb_{kib}"]) > 0.3
    assert last["steps"] == "3" and float(last["peak_ratio"]) > 0 and float(last["cpu_ratio"]) > 0
