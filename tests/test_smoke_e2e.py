"""The walking skeleton end to end, all real: `agentrl demo --smoke` starts embedded Redis, an SGLang server on CPU
(tiny model), the trainer process (cold-start SFT, then GRPO with FSDP2) and the local sandbox; two RL steps; SGLang
serves version 2 at the end; every process is stopped, also on Ctrl-C. Two held-out problems are evaluated before
and after SFT, after RL and during RL at every version (`data.heldout_every=1`: the rollout actor serves the
evaluation while its `run` goes on). The trainer rank allocates with the heap `trainer.malloc` auto chose (glibc for
this fp32 trainer on a machine with 16 GiB or more, else jemalloc preloaded by Ray)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from agentrl.data.arithmetic import FAMILIES

pytestmark = [pytest.mark.slow, pytest.mark.sglang, pytest.mark.redis]  # the run starts its own of each

AGENTRL = [sys.executable, "-m", "agentrl.cli"]
HELDOUT = ["data.num_heldout=2", "data.heldout_every=1"]


def _alive(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2):
            return True
    except OSError:
        return False


def _processes_mentioning(text: str) -> list[str]:
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if text in cmd and p.pid != os.getpid():
            found.append(f"{p.pid}: {cmd[:200]}")
    return found


def _alive_in_recorded_groups(run_dir: Path) -> list[str]:
    """Processes still alive in the process groups the run recorded (SGLang servers and all their children)."""
    import psutil

    groups = {json.loads(x)["pid"] for x in (run_dir / "logs" / "processes.jsonl").read_text().splitlines() if x}
    alive = []
    for p in psutil.process_iter(["pid", "name", "status"]):
        try:
            if os.getpgid(p.pid) in groups and p.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(f"{p.pid} {p.info['name']}")
        except (ProcessLookupError, psutil.Error):
            pass
    return alive


def _ray_of(driver_pid: int) -> list[str]:
    """Processes of the Ray cluster ``driver_pid`` started (Ray names its session directory after the driver's
    pid); other Ray clusters on the machine are not this run's business."""
    return [p for p in _processes_mentioning(f"_{driver_pid}/") if "/ray/session_" in p]


@pytest.fixture(scope="module")
def smoke_driver(tmp_path_factory) -> tuple[Path, int]:
    """The run directory of one `agentrl demo --smoke` and the pid its driver had."""
    runs = tmp_path_factory.mktemp("runs")
    proc = subprocess.Popen(
        [*AGENTRL, "demo", "--smoke", f"runs_dir={runs}", "name=smoke", "engine.record_requests=true",
         "rollout.skip_solved_window=1", *HELDOUT],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        out, err = proc.communicate(timeout=1500)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-5000:]
    (runs / "driver.log").write_text(out + err)
    return runs / "smoke", proc.pid


@pytest.fixture(scope="module")
def smoke_run(smoke_driver: tuple[Path, int]) -> Path:
    return smoke_driver[0]


def _gone(processes: Callable[[], list[str]], timeout_s: float = 30.0) -> list[str]:
    """``processes()`` once it is empty, or what it still lists after ``timeout_s`` (a process may take a moment
    to exit after its parent returned)."""
    deadline = time.monotonic() + timeout_s
    while (alive := processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_summary_and_run_directory(smoke_run: Path):
    summary = json.loads((smoke_run / "summary.json").read_text())
    assert summary["engine"] == "sglang"
    assert summary["steps"] == 2 and summary["final_weight_version"] == 2
    assert summary["served_weight_version"] == 2, "SGLang must serve the last version at the end"
    assert summary["trajectories_consumed"] == 16 == summary["trajectories_produced"]
    for key in ("trajectories_dropped_stale", "wall_time_s", "reward_first", "reward_last"):
        assert key in summary
    metrics = _jsonl(smoke_run / "metrics.jsonl")
    assert [m["weight_version"] for m in metrics] == [1, 2]
    for m in metrics:
        for key in ("step", "reward_mean", "num_trajectories", "tokens", "staleness_mean", "staleness_max", "time_s"):
            assert key in m, key
    for v in (0, 1, 2):
        assert (smoke_run / "weights" / f"v{v}" / "config.json").exists()
        assert list((smoke_run / "weights" / f"v{v}").glob("*.safetensors"))
    assert (smoke_run / "config.yaml").exists() and list((smoke_run / "checkpoints").iterdir())
    for log in ("sglang.log", "trainer-0.log", "rollout.log"):
        assert (smoke_run / "logs" / log).exists(), log
    assert summary["books_balanced"] and summary["trajectories_left_in_queue"] == 0
    assert (smoke_run / "report.md").exists() and (smoke_run / "report.png").exists()


def test_summary_accounts_for_the_memory_of_every_process(smoke_run: Path):
    """summary.json's memory block (agentrl/launcher/memory.py): every side sampled its own processes."""
    memory = json.loads((smoke_run / "summary.json").read_text())["memory"]
    per = memory["per_process"]
    for role in ("driver", "redis", "ray", "rollout", "sglang", "trainer-0"):
        assert per.get(role, 0) > 0, (role, per)
    # each of these imports torch (> 0.1 GiB resident); SGLang's tree is three such processes (launcher,
    # scheduler with the model, detokenizer); the embedded Redis is small
    for role in ("driver", "rollout", "trainer-0"):
        assert per[role] > 0.1, (role, per)
    assert per["sglang"] > 0.3 and per["redis"] < 0.5, per
    assert 0.5 < memory["peak_concurrent_gb"] <= memory["sum_of_peaks_gb"] < memory["total_ram_gb"], memory
    # torch's libraries are mapped by every process: RSS counts them in each, RssAnon in none
    assert 0.3 < memory["peak_concurrent_anon_gb"] < memory["peak_concurrent_gb"], memory
    assert memory["sum_of_peaks_gb"] == pytest.approx(sum(per.values()), abs=0.01)
    assert memory["processes"] >= 6 and memory["interval_s"] == 1.0
    assert "peak memory: " in (smoke_run / "report.md").read_text()


def test_the_trainer_process_allocates_with_the_heap_auto_chose(smoke_run: Path):
    """``trainer.malloc`` auto (the default) for the smoke recipe's fp32 trainer: glibc's heap on a machine with
    FAST_HEAP_MIN_GIB of memory or more (CI's), else jemalloc, which Ray preloads into the rank's process."""
    from agentrl import heap

    log = (smoke_run / "logs" / "trainer-0.log").read_text()
    driver = (smoke_run.parent / "driver.log").read_text()  # the controller asked the rank which malloc it has
    chosen, why = heap.choose("auto", "never", separate_process=True, dtype="fp32")
    if chosen == "jemalloc":
        assert "jemalloc serves this process's heap" in log
        assert "trainer ranks allocate with jemalloc (" in driver and "started without jemalloc" not in driver
    else:
        assert f"trainer.malloc auto: glibc ({why})" in driver
        assert "jemalloc serves this process's heap" not in log and "allocate with jemalloc" not in driver


def test_every_process_was_stopped(smoke_driver: tuple[Path, int]):
    smoke_run, driver_pid = smoke_driver
    summary = json.loads((smoke_run / "summary.json").read_text())
    assert not _alive(summary["engine_url"])
    assert _processes_mentioning(str(smoke_run)) == []
    assert _ray_of(driver_pid) == [], "the local Ray cluster must be shut down"
    assert _alive_in_recorded_groups(smoke_run) == [], "SGLang children (scheduler, detokenizer) must be gone"


def test_trajectories_hold_exactly_what_sglang_saw_and_returned(smoke_run: Path):
    trajectories = _jsonl(smoke_run / "rollouts.jsonl")
    every = _jsonl(smoke_run / "engine_requests.jsonl")
    calls = [c for c in every if not str(c["key"]).startswith("heldout-")]  # the held-out evaluations' own
    assert len(trajectories) == 16 and len(calls) < len(every)
    matched: dict[str, list[dict]] = {t["trajectory_id"]: [] for t in trajectories}
    for c in calls:  # each engine call belongs to exactly one trajectory: the one it is a prefix of
        n, m = len(c["input_ids"]), len(c["output_ids"])
        owners = [t for t in trajectories if t["group_id"] == c["key"]
                  and t["token_ids"][:n] == c["input_ids"] and t["token_ids"][n:n + m] == c["output_ids"]]
        assert owners, "an engine answer that is in no trajectory"
        # samples of a group may produce the same tokens: give the call to one that has no call at this point yet
        free = [t for t in owners if all(len(x["input_ids"]) != n for x in matched[t["trajectory_id"]])]
        matched[(free or owners)[0]["trajectory_id"]].append(c)
    with_tools = 0
    for t in trajectories:
        ids, mask, lps = t["token_ids"], t["loss_mask"], t["behavior_logprobs"]
        mine = matched[t["trajectory_id"]]
        for c in mine:  # what SGLang returned sits right after what it was sent, marked as model tokens
            n, m = len(c["input_ids"]), len(c["output_ids"])
            assert mask[n:n + m] == [1] * m
            assert lps[n:n + m] == pytest.approx(c["logprobs"], abs=1e-6)
            assert t["weight_versions"][n:n + m] == c["versions"]
        assert sum(mask) == sum(len(c["output_ids"]) for c in mine), "model tokens SGLang never returned"
        last = max(mine, key=lambda c: len(c["input_ids"]))
        assert ids == last["input_ids"] + last["output_ids"]  # an episode ends on the engine's last answer
        assert mask[: t["prompt_len"]] == [0] * t["prompt_len"]
        obs = [i for i in range(t["prompt_len"], len(ids)) if mask[i] == 0]
        assert all(t["weight_versions"][i] == -1 for i in obs)
        if t["turns"] and t["turns"][0][6]:  # tool results of the first turn
            with_tools += 1
            assert obs, "a tool call must add observation tokens with loss mask 0"
    assert with_tools > 0, "after cold-start SFT the tiny model should write <code> at least once"


def test_rollout_pass_rate_per_version_matches_the_rollouts(smoke_run: Path):
    summary = json.loads((smoke_run / "summary.json").read_text())
    counts: dict[str, list[int]] = {}
    for t in _jsonl(smoke_run / "rollouts.jsonl"):  # no dynamic sampling here: every group was queued
        versions = [v for v, m in zip(t["weight_versions"], t["loss_mask"]) if m]
        c = counts.setdefault(str(max(versions)), [0, 0])
        c[0] += t["reward_breakdown"].get("correct", t["reward"]) >= 1
        c[1] += 1
    assert summary["rollout_solve_rate_by_version"] == {v: round(s / n, 4) for v, (s, n) in sorted(counts.items())}
    assert set(counts) == {"0", "1"}
    # the tiny model never answers right, so SkipSolved (on here) never finds a mastered prompt
    assert summary["tasks_skipped_solved"] == 0
    # the same groups by wording: every episode counted once, under a generated problem's template, none solved
    by_key = summary["rollout_solve_by_key"]
    assert sum(k["episodes"] for k in by_key.values()) == sum(n for _, n in counts.values())
    assert set(by_key) <= {t.text for family in FAMILIES.values() for t in family}
    assert summary["rollout_keys_never_solved"] == summary["rollout_keys_seen"] == len(by_key) > 0


def test_held_out_accuracy_was_evaluated_during_rl(smoke_run: Path):
    summary = json.loads((smoke_run / "summary.json").read_text())
    evals = json.loads((smoke_run / "evals.json").read_text())
    assert set(evals) == {"before", "sft", "v1", "after"}  # v2 is the final version: the "after" evaluation's
    v1 = evals["v1"]
    assert not v1.get("failed"), v1
    assert v1["version"] == 1 and v1["version_end"] in (1, 2) and v1["versions_changed"] == (v1["version_end"] != 1)
    assert v1["n"] + v1["errors"] == 2 and 0 < v1["t_rl_s"] < v1["t_run_s"]
    assert len(_jsonl(smoke_run / "eval_v1.jsonl")) == 2
    # the SFT policy's evaluation ran beside RL's first rollouts (it starts once RL has started) and, holding
    # weight loads back, on v0 to its end (its version is read when it ends)
    sft = evals["sft"]
    assert sft["version"] == 0 and 0 <= sft["t_rl_s"] < v1["t_rl_s"], sft
    curve = summary["heldout_curve"]
    assert [(p["label"], p["version"]) for p in curve] == [("sft", 0), ("v1", 1), ("after", 2)]
    assert curve[0]["t_rl_s"] == 0 and curve[1]["t_rl_s"] < curve[2]["t_rl_s"]
    # the tiny random model never answers right
    assert summary["time_to_heldout_0.9_s"] is None and summary["time_to_heldout_0.9_rl_s"] is None
    assert "Time to held-out accuracy 0.9" in (smoke_run / "report.md").read_text()


def test_second_step_was_generated_by_v1(smoke_run: Path):
    trajectories = _jsonl(smoke_run / "rollouts.jsonl")
    versions = [sorted({v for v, m in zip(t["weight_versions"], t["loss_mask"]) if m}) for t in trajectories]
    assert versions[:8] == [[0]] * 8 and versions[8:] == [[1]] * 8  # η = 0: strictly alternating


@pytest.mark.parametrize(("sig", "code", "said"), [(signal.SIGINT, 130, "interrupted"),
                                                   (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_ctrl_c_or_sigterm_stops_every_process(tmp_path: Path, sig: signal.Signals, code: int, said: str,
                                               request: pytest.FixtureRequest):
    """SIGTERM (kill, a cluster scheduler) takes Ctrl-C's path: before, Ray's handler aborted the controller (exit
    134) and the clean-up never ran. The SIGINT run starts its own SGLang server, which must be stopped; the SIGTERM
    run is on the session's server (``engine.url``: a server start-up less, ~40 s), which it must leave serving."""
    runs = tmp_path / "runs"
    external = request.getfixturevalue("shared_server") if sig == signal.SIGTERM else None
    on_external = [f"engine.url={external}", "engine.dtype=float32"] if external else []
    # a suite started in the background (`cmd &` in a script, nohup) has SIGINT ignored, which a child inherits and
    # Python keeps (asyncio.run then installs no handler): the run would go on to its end (seen: exit 0 after all
    # 50 steps). Handled here while it starts, SIGINT is at its default in the child (exec resets handled signals).
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([*AGENTRL, "demo", "--smoke", f"runs_dir={runs}", "name=interrupted",
                                 "sft.enabled=false", "steps=50", *on_external],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    finally:
        signal.signal(signal.SIGINT, before)
    run_dir = runs / "interrupted"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not (run_dir / "rollouts.jsonl").exists():
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(1)
    assert (run_dir / "rollouts.jsonl").exists(), "the run never started producing rollouts"
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == code, out[-3000:]
    assert f"{said}: every process of the run was stopped" in out
    assert _gone(lambda: _processes_mentioning(str(run_dir))) == []
    assert _gone(lambda: _ray_of(proc.pid)) == []
    if external:  # nothing of the server's in the run's ledger of process groups to kill, and it serves on
        assert not (run_dir / "logs" / "processes.jsonl").exists()
        assert request.getfixturevalue("sglang_server").alive(), "a run stopped an SGLang server it did not start"
        # /health generates a token: it may wait behind the stopped run's last requests for a while
        assert _gone(lambda: [] if _alive(external) else ["no answer"], timeout_s=60) == []
        return
    assert _gone(lambda: _alive_in_recorded_groups(run_dir)) == []
    log = (run_dir / "logs" / "rollout.log").read_text()
    urls = [w for line in log.splitlines() if "starting sglang on" in line
            for w in line.split() if w.startswith("http")]
    assert urls, "the SGLang server was started and its URL logged"
    assert not _alive(urls[0])


def test_a_used_run_directory_is_refused_then_resumed(smoke_run: Path, shared_server: str):
    """Runs last in this module (it extends the shared run): the same command again is refused before anything
    starts; --resume continues after the last checkpoint with the next step and version, books balanced. The
    resumed segment runs on the session's SGLang server (``engine.url``, a server start-up less; the first segment
    started its own): it loads the checkpoint's weights into it."""
    runs, name = smoke_run.parent, smoke_run.name
    again = [*AGENTRL, "demo", "--smoke", f"runs_dir={runs}", f"name={name}", "engine.record_requests=true",
             "rollout.skip_solved_window=1", "monitor.live=false", *HELDOUT]
    logs_before = sorted(p.name for p in (smoke_run / "logs").iterdir())
    refused = subprocess.run(again, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and "already holds a run" in refused.stderr and "--resume" in refused.stderr
    assert sorted(p.name for p in (smoke_run / "logs").iterdir()) == logs_before  # nothing was started
    resumed = subprocess.run([*again, "steps=3", f"engine.url={shared_server}", "engine.dtype=float32", "--resume"],
                             capture_output=True, text=True, timeout=1500)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    summary = json.loads((smoke_run / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2 and summary["final_weight_version"] == 3
    assert summary["served_weight_version"] == 3 and summary["books_balanced"], summary
    assert summary["trajectories_consumed"] == 8 == summary["trajectories_produced"]  # this segment: one step
    assert [m["step"] for m in _jsonl(smoke_run / "metrics.jsonl")] == [1, 2, 3]
    assert (smoke_run / "weights" / "v3" / "config.json").exists()
    # the held-out evaluations of the first segment are kept; this one adds v2 (its new final version is 3)
    assert [p["label"] for p in summary["heldout_curve"]] == ["sft", "v1", "v2", "after"]
