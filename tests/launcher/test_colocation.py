"""resources.placement: split, colocated or auto — validation, the rule auto follows, what each gives the two sides
(cores, thread counts, SGLang's memory handover on GPU), and one real colocated run whose processes are checked
for the cores and threads they were given."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from agentrl.errors import ConfigError
from agentrl.launcher.colocation import (
    MEMORY_SAVER_FLAG,
    MemoryHandover,
    apply_placement,
    choose_placement,
    process_cores,
)
from agentrl.launcher.config import load_config

# --- validation ------------------------------------------------------------------------------------------------------

def test_colocated_with_staleness_is_refused_with_what_to_do() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["resources.placement=colocated", "rollout.max_staleness=1"])
    text = str(err.value)
    assert "resources.placement: colocated needs rollout.max_staleness: 0 (got 1)" in text
    assert "set rollout.max_staleness=0, or resources.placement=split" in text


def test_an_unknown_placement_names_the_choices() -> None:
    with pytest.raises(ConfigError, match="'split', 'colocated' or 'auto'"):
        load_config(None, ["resources.placement=shared"])


@pytest.mark.parametrize("overrides", [
    ["resources.placement=colocated"],  # max_staleness defaults to 0
    ["resources.placement=colocated", "rollout.max_staleness=0"],
    ["resources.placement=auto", "rollout.max_staleness=2"],
    ["resources.placement=split", "rollout.max_staleness=1"],
])
def test_valid_placements_load(overrides: list[str]) -> None:
    assert load_config(None, overrides).resources.placement == overrides[0].split("=")[1]


# --- the choice ------------------------------------------------------------------------------------------------------

SPLIT_CORES = ["resources.rollout_cores=[0]", "resources.trainer_cores=[1]"]


def test_auto_colocates_when_the_phases_alternate() -> None:
    choice = choose_placement(load_config(None, ["resources.placement=auto", *SPLIT_CORES]), available=[0, 1, 2])
    assert choice.placement == "colocated" and "max_staleness 0" in choice.reason
    # the union of the cores the split would have divided, not every core of the machine
    assert choice.rollout_cores == choice.trainer_cores == [0, 1]
    assert choice.engine_threads == choice.trainer_threads == 2
    assert not choice.release_engine_memory  # CPU: nothing to hand over


def test_auto_splits_when_rollout_runs_ahead() -> None:
    choice = choose_placement(load_config(None, ["resources.placement=auto", "rollout.max_staleness=1",
                                                 *SPLIT_CORES]), available=[0, 1])
    assert choice.placement == "split" and "max_staleness 1" in choice.reason
    assert (choice.rollout_cores, choice.trainer_cores) == ([0], [1])
    assert choice.engine_threads == choice.trainer_threads == 1


def test_colocated_without_cores_takes_every_core_and_shares_them_among_ranks() -> None:
    choice = choose_placement(load_config(None, ["resources.placement=colocated",
                                                 "resources.trainer_world_size=2"]), available=[3, 1, 2, 0])
    assert choice.rollout_cores == choice.trainer_cores == [0, 1, 2, 3]
    assert choice.engine_threads == 4 and choice.trainer_threads == 2  # two ranks, two threads each


def test_split_without_cores_leaves_everything_as_it_was() -> None:
    cfg = load_config(None, [])
    choice = choose_placement(cfg, available=[0, 1])
    assert choice.placement == "split" and choice.rollout_cores is None and choice.trainer_cores is None
    assert choice.engine_threads is None and choice.trainer_threads is None
    applied = apply_placement(cfg, choice)
    assert applied.trainer.num_threads is None and "OMP_NUM_THREADS" not in applied.engine.server.env


def test_debug_mode_colocated_pins_nothing_but_sets_threads() -> None:
    choice = choose_placement(load_config(None, ["resources.placement=colocated", "resources.ray=false"]),
                              available=[0, 1])
    assert choice.rollout_cores is None and choice.trainer_cores is None
    assert choice.engine_threads == choice.trainer_threads == 2


def test_applied_choice_sets_threads_unless_the_user_did() -> None:
    cfg = load_config(None, ["resources.placement=colocated"])
    applied = apply_placement(cfg, choose_placement(cfg, available=[0, 1]))
    assert applied.resources.placement == "colocated"
    assert applied.resources.rollout_cores == applied.resources.trainer_cores == [0, 1]
    assert applied.trainer.num_threads == 2 and applied.engine.server.env["OMP_NUM_THREADS"] == "2"
    mine = load_config(None, ["resources.placement=colocated", "trainer.num_threads=1",
                              "engine.env={OMP_NUM_THREADS: '1'}"])
    applied = apply_placement(mine, choose_placement(mine, available=[0, 1]))
    assert applied.trainer.num_threads == 1 and applied.engine.server.env["OMP_NUM_THREADS"] == "1"


def test_auto_resolves_in_the_saved_config() -> None:
    cfg = load_config(None, ["resources.placement=auto"])
    assert apply_placement(cfg, choose_placement(cfg, available=[0, 1])).resources.placement == "colocated"


def test_gpu_colocated_starts_sglang_with_the_memory_saver() -> None:
    cfg = load_config(None, ["resources.placement=colocated", "engine.device=cuda"])
    choice = choose_placement(cfg, available=[0, 1])
    assert choice.release_engine_memory
    assert MEMORY_SAVER_FLAG in apply_placement(cfg, choice).engine.server.extra_args
    external = load_config(None, ["resources.placement=colocated", "engine.device=cuda", "engine.url=http://x:1"])
    assert not choose_placement(external, available=[0, 1]).release_engine_memory  # not ours to restart


def test_process_cores_reads_affinity_and_omp_threads() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
                             env={**os.environ, "OMP_NUM_THREADS": "3"}, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "up\n"  # running python, its environ set
        os.sched_setaffinity(child.pid, {sorted(os.sched_getaffinity(0))[0]})
        seen = process_cores(child.pid)
        assert seen["cores"] == [sorted(os.sched_getaffinity(0))[0]] and seen["omp_num_threads"] == "3"
    finally:
        child.kill()
        child.wait()


# --- GPU handover, in order ------------------------------------------------------------------------------------------

class _Log:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def release_memory(self) -> None:
        self.calls.append("release")

    async def resume_memory(self) -> None:
        self.calls.append("resume")

    async def put(self, group: list[str]) -> None:
        self.calls.append(f"put {group[0]}")

    async def load(self, wv: object) -> int:
        self.calls.append(f"load v{wv.version}")
        return int(wv.version)


def test_sglang_releases_before_the_last_group_of_each_step_and_resumes_before_a_load() -> None:
    log = _Log()
    handover = MemoryHandover(log, log, log.load, groups_per_step=2)

    async def two_steps() -> None:
        for step in (1, 2):
            await handover.put([f"g{step}a"])
            await handover.put([f"g{step}b"])
            assert await handover.load_weights(SimpleNamespace(version=step)) == step

    asyncio.run(two_steps())
    assert log.calls == ["put g1a", "release", "put g1b", "resume", "load v1",
                         "put g2a", "release", "put g2b", "resume", "load v2"]
    assert handover.handovers == 2


# --- a real colocated run ----------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.redis  # the run starts its embedded Redis and its own SGLang server
def test_a_colocated_run_gives_both_sides_every_core(tmp_path: Path, tiny_model_path: Path) -> None:
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        pytest.skip("needs two cores to tell colocated from split")
    config = {
        "name": "colocated", "model": "tiny", "steps": 2, "runs_dir": str(tmp_path / "runs"),
        "sft": {"enabled": True, "steps": 2, "num_traces": 4, "batch_size": 2}, "engine": {"dtype": "float32"},
        "data": {"num_heldout": 2},
        "rollout": {"n_samples": 2, "groups_per_step": 2, "max_new_tokens": 16, "max_turns": 2,
                    "max_response_tokens": 48, "max_context_tokens": 192},
        "trainer": {"micro_batch_tokens": 2048, "dtype": "fp32"},
        # what the demo's split would divide: colocated hands both cores to both sides
        "resources": {"placement": "colocated", "rollout_cores": cores[:1], "trainer_cores": cores[1:]},
        "monitor": {"live": False, "prometheus_port": None, "tensorboard": False},
    }
    path = tmp_path / "colocated.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", str(path)], capture_output=True, text=True,
                          timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run = tmp_path / "runs" / "colocated"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_weight_version"] == 2 and summary["books_balanced"], summary
    placed = summary["placement"]
    assert placed["placement"] == "colocated" and placed["rollout_cores"] == placed["trainer_cores"] == cores
    applied = placed["applied"]
    assert applied["rollout"]["cores"] == cores
    (engine,) = applied["engine"]
    assert engine["cores"] == cores and engine["omp_num_threads"] == "2"  # not Ray's 1, inherited from the actor
    assert applied["trainer"]["cores"] == cores and applied["trainer"]["torch_threads"] == 2
    assert yaml.safe_load((run / "config.yaml").read_text())["resources"]["placement"] == "colocated"
    # colocated, the held-out evaluation of the base model first waits for SFT's v0 (wait_for_version): it ran.
    # (Here SFT ends long before SGLang is up, so the order itself is not what this checks.)
    assert summary["heldout_accuracy_before"] is not None and summary["heldout_accuracy_sft"] is not None
