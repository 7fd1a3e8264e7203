"""Held-out evaluations during RL (``data.heldout_every``), the accuracy curve and the time to accuracy: the logic
around the rollout process, with a scripted fake of it (the real run: tests/test_smoke_e2e.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from agentrl.errors import ConfigError
from agentrl.launcher import recipes
from agentrl.launcher.config import RunConfig, load_config
from agentrl.launcher.heldout_curve import (
    MidRunEvals,
    Timeline,
    curve_figures,
    evaluating_during,
    forget_later_versions,
    heldout_curve,
    time_to_accuracy,
)
from agentrl.launcher.report import summarize, write_report


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeRollout:
    """Serves the versions of ``script`` one per ``weight_version`` call (the last one from then on); an evaluation
    advances the clock by 10 s and, if ``advance_during``, the served version by one; ``fail_at`` versions raise."""

    def __init__(self, script: list[int], clock: FakeClock, *, advance_during: bool = False,
                 fail_at: frozenset[int] = frozenset()) -> None:
        self.script, self.clock, self.advance_during, self.fail_at = list(script), clock, advance_during, fail_at
        self.served = self.script[0]
        self.evaluated: list[str] = []

    async def weight_version(self) -> int:
        if self.script:
            self.served = self.script.pop(0)
        return self.served

    async def evaluate_heldout(self, label: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        self.evaluated.append(label)
        if self.served in self.fail_at:
            raise RuntimeError("sandbox gone")
        self.clock.now += 10.0
        if self.advance_during:
            self.served += 1
        return ({"label": label, "version": self.served, "n": 2, "accuracy": self.served / 10, "reward_mean": 0.5,
                 "errors": 0}, [{"task_id": "t0", "correct": True}, {"task_id": "t1", "correct": False}])


def _evals(rollout: FakeRollout, clock: FakeClock, evals: dict[str, Any], tmp_path: Path, *, every: int,
           final: int) -> MidRunEvals:
    timeline = Timeline(run_start=0.0, rl_start=50.0, clock=clock)

    def write(label: str, records: list[dict[str, Any]]) -> None:
        (tmp_path / f"eval_{label}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    return MidRunEvals(rollout, every=every, final_version=final, evals=evals,
                       save=lambda: (tmp_path / "evals.json").write_text(json.dumps(evals)), write=write,
                       timeline=timeline, poll_s=0.001)


async def _run_until_script_ends(mid: MidRunEvals, rollout: FakeRollout) -> None:
    stop = asyncio.Event()
    task = asyncio.ensure_future(mid.run(stop))
    while rollout.script:
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_evaluates_each_multiple_once_below_the_final_version(tmp_path: Path) -> None:
    clock = FakeClock()
    rollout = FakeRollout([0, 0, 1, 2, 2, 3, 5, 5, 6, 8], clock)  # 4 is never served: 5 is the next due
    evals: dict[str, Any] = {}
    await _run_until_script_ends(_evals(rollout, clock, evals, tmp_path, every=2, final=8), rollout)
    assert rollout.evaluated == ["v2", "v5", "v6"]  # not 8: the final version is the "after" evaluation's
    v2 = evals["v2"]
    assert (v2["version"], v2["version_end"], v2["versions_changed"]) == (2, 2, False)
    assert (v2["t_rl_s"], v2["t_run_s"]) == (50.0, 100.0)  # at the evaluation's start
    assert evals["v5"]["t_run_s"] == 110.0 and evals["v5"]["accuracy"] == 0.5
    assert len((tmp_path / "eval_v6.jsonl").read_text().splitlines()) == 2
    assert set(json.loads((tmp_path / "evals.json").read_text())) == {"v2", "v5", "v6"}


async def test_a_version_change_during_an_evaluation_is_recorded(tmp_path: Path) -> None:
    clock = FakeClock()
    rollout = FakeRollout([0, 3], clock, advance_during=True)
    evals: dict[str, Any] = {}
    await _run_until_script_ends(_evals(rollout, clock, evals, tmp_path, every=3, final=9), rollout)
    assert rollout.evaluated == ["v3"]  # 4 is served afterwards, and 6 is the next due
    assert (evals["v3"]["version"], evals["v3"]["version_end"], evals["v3"]["versions_changed"]) == (3, 4, True)


async def test_a_failed_evaluation_is_recorded_and_the_next_one_runs(tmp_path: Path) -> None:
    clock = FakeClock()
    rollout = FakeRollout([1, 2, 3, 4], clock, fail_at=frozenset({2}))
    evals: dict[str, Any] = {}
    await _run_until_script_ends(_evals(rollout, clock, evals, tmp_path, every=2, final=10), rollout)
    assert rollout.evaluated == ["v2", "v4"]
    assert evals["v2"]["failed"] and "sandbox gone" in evals["v2"]["error"] and "accuracy" not in evals["v2"]
    assert not (tmp_path / "eval_v2.jsonl").exists() and evals["v4"]["accuracy"] == 0.4
    figures = curve_figures(evals)
    assert [p["label"] for p in figures["heldout_curve"]] == ["v4"] and figures["heldout_evals_failed"] == 1


async def test_a_resumed_run_keeps_its_records_up_to_its_checkpoint(tmp_path: Path) -> None:
    clock = FakeClock()
    rollout = FakeRollout([3, 4, 6], clock)
    old = {"sft": {"label": "sft", "version": 0, "accuracy": 0.5},
           **{f"v{v}": {"label": f"v{v}", "version": v, "accuracy": 0.9} for v in (2, 4, 8)}}
    evals: dict[str, Any] = dict(old)
    for label in old:
        (tmp_path / f"eval_{label}.jsonl").write_text("{}\n")
    # resumed from the checkpoint of step 3: the first process's v4 and v8 are dropped (the driver does this on
    # every resume, whether or not it evaluates during RL), v4 and after are trained anew
    dropped = forget_later_versions(evals, 3, lambda label: (tmp_path / f"eval_{label}.jsonl").unlink())
    assert dropped == ["v4", "v8"] and set(evals) == {"sft", "v2"}
    assert sorted(f.name for f in tmp_path.glob("eval_*")) == ["eval_sft.jsonl", "eval_v2.jsonl"]
    mid = _evals(rollout, clock, evals, tmp_path, every=2, final=10)
    mid.start_version = 3
    await _run_until_script_ends(mid, rollout)
    # served v3 (the checkpoint's, not a multiple of 2) is not evaluated; v4 and v6 are, anew
    assert rollout.evaluated == ["v4", "v6"] and evals["v2"] == old["v2"] and evals["v4"]["accuracy"] == 0.4
    assert "v8" not in evals and heldout_curve(evals)[-1]["label"] == "v6"


async def test_a_run_resumed_on_a_multiple_evaluates_it_unless_it_was_recorded(tmp_path: Path) -> None:
    clock = FakeClock()
    rollout = FakeRollout([4, 6], clock)
    mid = _evals(rollout, clock, {}, tmp_path, every=2, final=10)
    mid.start_version = 4  # the first process stopped before evaluating v4: its checkpoint's weights are v4
    await _run_until_script_ends(mid, rollout)
    assert rollout.evaluated == ["v4", "v6"]
    rollout = FakeRollout([4, 6], clock)
    mid = _evals(rollout, clock, {"v4": {"label": "v4", "version": 4, "accuracy": 0.9}}, tmp_path, every=2, final=10)
    mid.start_version = 4
    await _run_until_script_ends(mid, rollout)
    assert rollout.evaluated == ["v6"]
    rollout = FakeRollout([4, 6], clock)  # a failed record is no record: evaluated again
    evals = {"v4": {"label": "v4", "version": 4, "failed": True, "error": "RuntimeError: gone"}}
    mid = _evals(rollout, clock, evals, tmp_path, every=2, final=10)
    mid.start_version = 4
    await _run_until_script_ends(mid, rollout)
    assert rollout.evaluated == ["v4", "v6"] and evals["v4"]["accuracy"] == 0.4 and "failed" not in evals["v4"]


async def test_an_evaluation_under_way_is_finished_when_rl_ends(tmp_path: Path) -> None:
    clock = FakeClock()
    started, release = asyncio.Event(), asyncio.Event()

    class Slow(FakeRollout):
        async def evaluate_heldout(self, label: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
            started.set()
            await release.wait()
            return await super().evaluate_heldout(label)

    rollout = Slow([1], clock)
    evals: dict[str, Any] = {}

    async def rl() -> None:
        await started.wait()
        asyncio.get_running_loop().call_later(0.05, release.set)

    async with evaluating_during(_evals(rollout, clock, evals, tmp_path, every=1, final=5)):
        await rl()
    assert evals["v1"]["accuracy"] == 0.1  # the block ended while v1 was evaluated: its record was still kept


async def test_the_poller_is_cancelled_when_rl_fails(tmp_path: Path) -> None:
    clock = FakeClock()
    polls = 0

    class Counted(FakeRollout):
        async def weight_version(self) -> int:
            nonlocal polls
            polls += 1
            return 0

    mid = _evals(Counted([0], clock), clock, {}, tmp_path, every=1, final=5)
    with pytest.raises(RuntimeError, match="trainer died"):
        async with evaluating_during(mid):
            await asyncio.sleep(0.01)
            raise RuntimeError("trainer died")
    seen = polls
    await asyncio.sleep(0.02)  # 20 poll intervals
    assert seen > 0 and polls == seen, "the poller must stop with the block"


def test_curve_and_time_to_accuracy() -> None:
    evals = {"before": {"accuracy": 0.1, "reward_mean": 0.1},
             "sft": {"version": 0, "accuracy": 0.95, "reward_mean": 0.8, "t_run_s": 30.0},
             "v10": {"version": 10, "accuracy": 0.92, "reward_mean": 0.9, "t_rl_s": 200.0, "t_run_s": 260.0},
             "v5": {"version": 5, "accuracy": 0.85, "reward_mean": 0.85, "t_rl_s": 100.0, "t_run_s": 160.0},
             "after": {"version": 15, "accuracy": 0.97, "reward_mean": 0.95, "t_rl_s": 300.0, "t_run_s": 360.0}}
    curve = heldout_curve(evals)
    assert [(p["label"], p["version"], p["t_rl_s"]) for p in curve] == [
        ("sft", 0, 0.0), ("v5", 5, 100.0), ("v10", 10, 200.0), ("after", 15, 300.0)]
    assert curve[0]["t_run_s"] == 30.0 and set(curve[1]) == {"label", "version", "version_end", "accuracy",
                                                            "reward_mean", "t_rl_s", "t_run_s"}
    assert [p["version_end"] for p in curve] == [0, 5, 10, 15]  # records without an end: their start
    # the SFT point counts: at 0.95 the run was at 0.9 from the SFT evaluation's start on
    assert time_to_accuracy(curve, 0.9, "t_run_s") == 30.0 and time_to_accuracy(curve, 0.9, "t_rl_s") == 0.0
    assert time_to_accuracy(curve, 0.96, "t_run_s") == 360.0 and time_to_accuracy(curve, 0.96, "t_rl_s") == 300.0
    assert time_to_accuracy(curve, 0.99, "t_run_s") is None
    evals["sft"]["accuracy"] = 0.75  # then the first evaluation that reached 0.9 (v10), not the best (after)
    figures = curve_figures(evals)
    assert figures["time_to_heldout_0.9_s"] == 260.0 and figures["time_to_heldout_0.9_rl_s"] == 200.0
    assert curve_figures({}) == {"heldout_curve": [], "time_to_heldout_0.9_s": None,
                                 "time_to_heldout_0.9_rl_s": None, "heldout_evals_failed": 0}


def test_the_summary_and_report_carry_the_curve(tmp_path: Path) -> None:
    evals = {"sft": {"version": 0, "accuracy": 0.5, "reward_mean": 0.4, "t_run_s": 30.0},
             "v1": {"version": 1, "accuracy": 0.75, "reward_mean": 0.6, "t_rl_s": 20.0, "t_run_s": 70.0,
                    "version_end": 1, "versions_changed": False},
             "v2": {"version": 2, "accuracy": 0.7, "reward_mean": 0.6, "t_rl_s": 30.0, "t_run_s": 80.0,
                    "version_end": 4, "versions_changed": True},
             "after": {"version": 5, "accuracy": 0.8, "reward_mean": 0.7, "t_rl_s": 40.0, "t_run_s": 90.0}}
    summary = summarize(RunConfig(name="r"), tmp_path, rollout_stats={}, evals=evals, served_version=5,
                        engine_url="http://x", queue_left=0, trainer_restarts=0, wall_time_s=100.0)
    assert [(p["version"], p["version_end"]) for p in summary["heldout_curve"]] == [(0, 0), (1, 1), (2, 4), (5, 5)]
    assert summary["time_to_heldout_0.9_s"] is None and summary["time_to_heldout_0.9_rl_s"] is None
    write_report(tmp_path, summary)
    report = (tmp_path / "report.md").read_text()
    assert "Time to held-out accuracy 0.9" in report and "never reached" in report
    assert "| v1 | 1 | 0.750 | 0.600 | 20 | 70 |" in report and "| sft | 0 | 0.500 | 0.400 | 0 | 30 |" in report
    assert "| v2 | 2-4 | 0.700 |" in report  # new weights were loaded during that evaluation: it says which


def test_heldout_every_is_checked() -> None:
    cfg = load_config(None, ["data.num_heldout=4", "data.heldout_every=5"])
    assert cfg.data.heldout_every == 5 and RunConfig().data.heldout_every == 0
    with pytest.raises(ConfigError, match="heldout_every"):
        load_config(None, ["data.num_heldout=4", "data.heldout_every=-1"])
    with pytest.raises(ConfigError, match="num_heldout"):  # nothing to evaluate
        load_config(None, ["data.heldout_every=5"])


def test_the_demo_evaluates_every_fifth_version() -> None:
    cfg = load_config(None, [], base=recipes.DEMO)
    assert cfg.data.heldout_every == 5 and cfg.steps % 5 == 0
