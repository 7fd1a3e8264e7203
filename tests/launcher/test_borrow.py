"""resources.trainer_borrows_idle_cores: when it is on, the rollout side's beacon in a real Redis, the trainer's
probe of it, the cores and threads the trainer computes on as the rollout side goes idle and busy, and a real split
run whose trainer borrowed the rollout core (agentrl.launcher.cores)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import yaml

from agentrl.async_rollout.staleness import StalenessManager
from agentrl.errors import ConfigError
from agentrl.launcher.colocation import apply_placement, choose_placement
from agentrl.launcher.config import load_config
from agentrl.launcher.cores import CoreBorrower, IdleBeacon, idle_key, pin_to_cores, redis_idle_probe
from agentrl.queue import EmbeddedRedis, make_client

SPLIT = ["rollout.max_staleness=1", "resources.rollout_cores=[0]", "resources.trainer_cores=[1]",
         "resources.trainer_borrows_idle_cores=auto"]
TWO_CORES = sorted(os.sched_getaffinity(0))[:2]
needs_two_cores = pytest.mark.skipif(len(TWO_CORES) < 2, reason="needs two cores to lend one")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


# --- when it is on -----------------------------------------------------------------------------------------------------

def test_auto_borrows_with_split_cores_on_one_host_and_writes_it_in() -> None:
    cfg = load_config(None, SPLIT)
    choice = choose_placement(cfg, available=[0, 1])
    assert choice.trainer_borrows == [0] and "idle" in choice.borrow_reason
    assert apply_placement(cfg, choice).resources.trainer_borrows_idle_cores is True


@pytest.mark.parametrize(("overrides", "why"), [
    ([], "rollout_cores and trainer_cores"),  # split without pinned cores: nothing to lend
    (["resources.trainer_world_size=2"], "one trainer rank"),
    (["resources.trainer_num_gpus=1"], "a CPU trainer"),
    (["resources.trainer_resources={trainer_node: 1}"], "both sides on this host"),
    (["resources.ray_address=auto"], "both sides on this host"),
])
def test_auto_stays_off_where_borrowing_cannot_work_and_says_why(overrides: list[str], why: str) -> None:
    base = SPLIT if overrides else ["rollout.max_staleness=1", "resources.trainer_borrows_idle_cores=auto"]
    cfg = load_config(None, [*base, *overrides])
    choice = choose_placement(cfg, available=[0, 1])
    assert choice.trainer_borrows is None and why in choice.borrow_reason
    assert apply_placement(cfg, choice).resources.trainer_borrows_idle_cores is False


def test_colocated_and_false_do_not_borrow() -> None:
    colocated = choose_placement(load_config(None, ["resources.placement=colocated", *SPLIT[1:]]), available=[0, 1])
    assert colocated.trainer_borrows is None
    off = choose_placement(load_config(None, [*SPLIT, "resources.trainer_borrows_idle_cores=false"]),
                           available=[0, 1])
    assert off.trainer_borrows is None and "false" in off.borrow_reason
    default = choose_placement(load_config(None, SPLIT[:3]), available=[0, 1])  # off unless asked for
    assert default.trainer_borrows is None


def test_true_where_it_cannot_work_is_refused_with_what_it_needs() -> None:
    with pytest.raises(ConfigError, match="trainer_borrows_idle_cores: true needs resources.rollout_cores and "
                                          "trainer_cores"):
        load_config(None, ["resources.trainer_borrows_idle_cores=true"])
    cfg = load_config(None, ["resources.placement=auto", "rollout.max_staleness=0", *SPLIT[1:],
                             "resources.trainer_borrows_idle_cores=true"])
    with pytest.raises(ConfigError, match="needs split placement"):
        choose_placement(cfg, available=[0, 1])  # auto resolved to colocated (max_staleness 0)
    # true trusts the user about hosts (the trainer checks the host name anyway)
    joined = load_config(None, [*SPLIT, "resources.ray_address=auto", "resources.trainer_borrows_idle_cores=true"])
    assert choose_placement(joined, available=[0, 1]).trainer_borrows == [0]


# --- the beacon and the probe, in a real Redis -------------------------------------------------------------------------

async def _becomes(probe: Callable[[], bool], expected: bool, timeout_s: float = 5.0) -> bool:
    """Whether ``probe()`` reads ``expected`` within ``timeout_s`` (the beacon publishes a poke within a Redis round
    trip; its own refresh is 10 s in the test, so only the pokes can make it in time)."""
    deadline = time.monotonic() + timeout_s
    while probe() is not expected:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def test_the_beacon_shows_idleness_as_the_gate_and_other_work_change(redis_server: EmbeddedRedis) -> None:
    client = make_client(redis_server.url)
    key = idle_key("beacon-test")
    gate = StalenessManager(groups_per_step=1, max_staleness=1, max_running=2)
    other = {"busy": False}
    versions = {"served": 3, "published": 3}
    beacon = IdleBeacon(client, key, lambda: other["busy"] or gate.running > 0, lambda: versions["served"],
                        refresh_s=10.0)
    gate.listeners.append(beacon.poke)
    probe = redis_idle_probe(redis_server.url, key, lambda: versions["published"])
    try:
        assert not probe()  # nothing published yet
        beacon.start()
        assert await _becomes(probe, True) and await client.get(key) == f"{socket.gethostname()} 3".encode()
        versions["published"] = 4  # idle, but about to load the trainer's newest version: not free
        assert not probe()
        versions["served"] = 4
        await beacon.update()
        assert probe()
        assert 0 < await client.pttl(key) <= 2000  # expires by itself if the rollout side dies
        await gate.acquire()  # a group starts: the gate pokes, the key goes at once (no 10 s refresh to wait for)
        assert await _becomes(probe, False)
        await gate.release()
        assert await _becomes(probe, True)
        other["busy"] = True  # e.g. a held-out evaluation
        beacon.poke()
        assert await _becomes(probe, False)
        other["busy"] = False
        beacon.poke()
        assert await _becomes(probe, True)
        await client.set(key, "another-host 4", px=2000)  # a rollout side on another node lends nothing here
        assert not probe()
        await client.set(key, "garbage", px=2000)
        assert not probe()
        await beacon.update()
    finally:
        await beacon.aclose()
        assert await client.exists(key) == 0
        await client.aclose()
    assert not probe()


def test_an_unreachable_redis_reads_as_busy(tmp_path: Path) -> None:
    probe = redis_idle_probe(f"unix://{tmp_path}/no.sock", "k", lambda: 0, timeout_s=0.2)
    assert probe() is False


# --- the trainer's cores ---------------------------------------------------------------------------------------------

@needs_two_cores
def test_the_borrower_widens_and_narrows_cores_and_threads(restore_cores: None) -> None:
    own, lend = TWO_CORES[1:], TWO_CORES[:1]
    pin_to_cores(own)
    torch.set_num_threads(1)
    idle = {"now": False}
    borrower = CoreBorrower(own, lend, lambda: idle["now"], min_interval_s=0.0)
    borrower.adjust()
    assert os.sched_getaffinity(0) == set(own) and torch.get_num_threads() == 1 and not borrower.borrowing
    idle["now"] = True
    borrower.adjust()
    assert os.sched_getaffinity(0) == set(TWO_CORES) and torch.get_num_threads() == 2 and borrower.borrowing
    torch.set_num_threads(1)  # a new Trainer sets its own count: the next micro-batch widens it again
    borrower.adjust()
    assert torch.get_num_threads() == 2
    idle["now"] = False
    borrower.adjust()
    assert os.sched_getaffinity(0) == set(own) and torch.get_num_threads() == 1
    assert borrower.take_share() == 2 / 4 and borrower.take_share() is None
    idle["now"] = True
    borrower.adjust()
    borrower.close()  # the run ends borrowing: back to its own cores
    assert os.sched_getaffinity(0) == set(own) and torch.get_num_threads() == 1


def test_the_borrower_asks_at_most_every_min_interval() -> None:
    asked = []
    borrower = CoreBorrower([1], [0], lambda: asked.append(1) or False, min_interval_s=3600)
    for _ in range(5):
        borrower.adjust()
    assert len(asked) == 1 and borrower.take_share() == 0.0


def test_overlapping_or_empty_cores_are_refused() -> None:
    with pytest.raises(ValueError, match="disjoint"):
        CoreBorrower([0, 1], [1], lambda: True)
    with pytest.raises(ValueError, match="non-empty"):
        CoreBorrower([1], [], lambda: True)


# --- a real run ------------------------------------------------------------------------------------------------------

@needs_two_cores
@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.redis  # the run starts its embedded Redis; it uses the session's SGLang server
def test_a_split_run_lends_the_idle_rollout_core_to_the_trainer(tmp_path: Path, shared_server: str) -> None:
    config = {
        "name": "borrow", "model": "tiny", "steps": 3, "runs_dir": str(tmp_path / "runs"),
        "sft": {"enabled": True, "steps": 2, "num_traces": 4, "batch_size": 2},
        "engine": {"dtype": "float32", "url": shared_server},
        "data": {"num_heldout": 2},
        # η = 0: the rollout side waits for each version, so it idles through every trainer step
        "rollout": {"n_samples": 2, "groups_per_step": 2, "max_staleness": 0, "max_new_tokens": 16, "max_turns": 2,
                    "max_response_tokens": 48, "max_context_tokens": 192},
        "trainer": {"micro_batch_tokens": 64, "dtype": "fp32"},  # several micro-batches a step: several asks
        "resources": {"placement": "split", "rollout_cores": TWO_CORES[:1], "trainer_cores": TWO_CORES[1:],
                      "trainer_borrows_idle_cores": "auto"},
        "monitor": {"live": False, "prometheus_port": None, "tensorboard": False},
    }
    path = tmp_path / "borrow.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", str(path)], capture_output=True, text=True,
                          timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run = tmp_path / "runs" / "borrow"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_weight_version"] == 3 and summary["books_balanced"], summary
    assert summary["placement"]["trainer_borrows"] == TWO_CORES[:1]
    assert yaml.safe_load((run / "config.yaml").read_text())["resources"]["trainer_borrows_idle_cores"] is True
    placed = json.loads((run / "logs" / "trainer-0.placement.json").read_text())
    assert placed["cores"] == TWO_CORES[1:] and placed["borrows_cores"] == TWO_CORES[:1]
    shares = [json.loads(line)["cores_borrowed_share"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(shares) == 3 and all(s is not None for s in shares)
    assert max(shares) > 0, shares  # the trainer computed on the rollout core while the rollout side waited


def test_the_rollout_side_is_idle_only_when_its_gate_admits_nothing_more(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from agentrl.launcher.rollout_process import RolloutWorker

    worker = RolloutWorker(load_config(None, []), tmp_path, "redis://unused")
    assert not worker._is_busy() and worker._served() == -1  # before RL: nothing runs
    gate = StalenessManager(groups_per_step=2, max_staleness=0, max_running=4)
    worker.scheduler = SimpleNamespace(gate=gate, total_groups=4)  # type: ignore[assignment]
    assert worker._is_busy()  # nothing running, but the gate admits two groups: about to generate
    gate.started = 2  # version 0's groups done
    assert not worker._is_busy() and worker._served() == 0  # waits for the trainer's version 1
    gate.version = 1
    assert worker._is_busy()
    gate.started, gate.running = 3, 1
    assert worker._is_busy()
    gate.started, gate.running = 4, 0  # everything produced
    assert not worker._is_busy()
    worker._busy = 1  # a held-out evaluation
    assert worker._is_busy()
