"""Where the processes of a run run: the local Ray cluster runs our actors at the driver's CPU priority (not Ray's
nice 15); debug mode runs the trainer on a thread of the controller."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
from pydantic import ValidationError

from agentrl.launcher.config import RunConfig
from agentrl.launcher.placement import ray_init


def test_actors_of_the_local_cluster_run_at_the_drivers_priority() -> None:
    ray = ray_init(RunConfig())

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    # Ray's default (RAY_worker_niceness 15) would put the trainer, SGLang and the sandboxes behind any other
    # process on the machine
    assert ray.get(niceness.remote(), timeout=120) == os.nice(0)


async def test_debug_mode_trainer_thread_raises_its_error_as_is(tmp_path, monkeypatch) -> None:
    """Debug mode: the trainer runs on a thread of this process; its error reaches every waiter unchanged."""
    from agentrl.launcher import trainer_process
    from agentrl.launcher.placement import TrainerThread

    threads = []

    async def failing(cfg, run_dir, redis_url, *, rank):
        threads.append(threading.current_thread())
        raise ZeroDivisionError("in the trainer")

    monkeypatch.setattr(trainer_process, "train", failing)
    trainer = TrainerThread(RunConfig(resources={"ray": False}), tmp_path, "redis://unused")
    trainer.start()
    for _ in range(2):  # each controller call watches it, then stops watching
        with pytest.raises(ZeroDivisionError, match="in the trainer"):
            await trainer.wait()
    assert threads and threads[0] is not threading.main_thread() and trainer.restarts == 0


async def test_debug_mode_trainer_thread_is_cancelled_by_kill(tmp_path, monkeypatch) -> None:
    from agentrl.launcher import trainer_process
    from agentrl.launcher.placement import TrainerThread

    started, cancelled = threading.Event(), threading.Event()

    async def waits_for_the_queue(cfg, run_dir, redis_url, *, rank):
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    monkeypatch.setattr(trainer_process, "train", waits_for_the_queue)
    trainer = TrainerThread(RunConfig(resources={"ray": False}), tmp_path, "redis://unused")
    trainer.start()
    assert await asyncio.to_thread(started.wait, 30)
    await asyncio.to_thread(trainer.kill)
    assert cancelled.is_set() and not trainer._thread.is_alive()


def test_debug_mode_is_one_trainer_rank_and_no_cluster() -> None:
    with pytest.raises(ValidationError, match="one trainer rank"):
        RunConfig(resources={"ray": False, "trainer_world_size": 2})
    with pytest.raises(ValidationError, match="ray_address"):
        RunConfig(resources={"ray": False, "ray_address": "auto"})


def test_each_side_asks_for_its_own_custom_ray_resources() -> None:
    r = RunConfig(resources={"trainer_world_size": 2, "trainer_resources": {"trainer_node": 1},
                             "rollout_resources": {"rollout_node": 0.5}}).resources
    assert r.local_cluster_resources() == {"trainer_node": 2.0, "rollout_node": 0.5}  # what a local cluster offers
    assert RunConfig().resources.local_cluster_resources() == {}  # the default: any node, as before
    with pytest.raises(ValidationError, match="num_cpus"):
        RunConfig(resources={"trainer_resources": {"CPU": 1}})
    with pytest.raises(ValidationError, match="> 0"):
        RunConfig(resources={"rollout_resources": {"rollout_node": 0}})
    with pytest.raises(ValidationError, match="debug mode"):
        RunConfig(resources={"ray": False, "rollout_resources": {"rollout_node": 1}})


def _fake_rank_class(ray):
    @ray.remote
    class Rank:
        def __init__(self, cfg, run_dir, rank, cores) -> None:
            self.rank, self.malloc = rank, cfg.trainer.malloc

        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def pid(self) -> int:
            return os.getpid()

        def on_jemalloc(self) -> bool:
            from agentrl import heap

            return heap.jemalloc_loaded()

        def malloc_given(self) -> str:
            return self.malloc

        def rendezvous(self) -> tuple[str, int]:
            return ("192.0.2.10", 4567) if self.rank == 0 else ("not-rank-0", 1)

        def train(self, env: dict[str, str]) -> dict[str, str]:
            return env

    return Rank


async def test_trainer_ranks_meet_at_the_address_rank_0_found_on_its_node(tmp_path) -> None:
    """MASTER_ADDR/PORT come from the rank-0 actor (its node's IP and a port free there), not from the
    controller's node; LOCAL_RANK counts the ranks on the same node."""
    from agentrl.launcher.placement import TrainerGroup

    ray = ray_init(RunConfig())
    Rank = _fake_rank_class(ray)

    cfg = RunConfig(name="meet", resources={"trainer_world_size": 2, "trainer_num_cpus": 0.01})
    group = TrainerGroup(cfg, tmp_path, "redis://somewhere:6379/0", Rank)
    try:
        await group.start()
        envs = await asyncio.gather(*group.refs)
    finally:
        group.kill()
    here = ray.get_runtime_context().get_node_id()
    assert group.node_ids == [here, here]
    assert len(set(group.pids)) == 2 and os.getpid() not in group.pids  # the controller skips their trees
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in envs] == [("0", "0", "2"), ("1", "1", "2")]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["AGENTRL_REDIS_URL"]) for e in envs} == {
        ("192.0.2.10", "4567", "redis://somewhere:6379/0")}


@pytest.mark.parametrize(("overrides", "memory_gib", "chosen", "said"), [
    ({}, 24, "jemalloc", "trainer ranks allocate with jemalloc ("),
    ({"dtype": "bf16"}, 24, "jemalloc",
     "; trainer.malloc auto: a bf16 trainer: glibc's heap holds more and was no faster in the demo)"),
    ({"dtype": "fp32"}, 8, "jemalloc", "; trainer.malloc auto: an fp32 trainer and 8.0 GiB of memory, under 16"),
    ({"dtype": "fp32"}, 24, "glibc", "trainer.malloc auto: glibc (an fp32 trainer and 24.0 GiB of memory"),
    ({"dtype": "fp32", "lora": {"r": 8}}, 24, "jemalloc", "; trainer.malloc auto: a LoRA trainer: the leaner heap"),
    ({"mmap_threshold_kb": 1024}, 24, "glibc", "trainer.malloc auto: glibc (trainer.mmap_threshold_kb 1024"),
    ({"device": "cuda"}, 24, "glibc", "trainer.malloc auto: glibc (a GPU trainer"),
])
async def test_malloc_auto_starts_the_ranks_with_its_choice_and_tells_them(tmp_path, caplog, monkeypatch, overrides,
                                                                         memory_gib, chosen, said) -> None:
    """``trainer.malloc: auto`` (the default): the ranks' processes start with jemalloc preloaded, or not, and each
    rank's config carries the choice (so a rank that asked for jemalloc and lacks it warns in its own log). The
    machine's memory is the test's (an fp32 trainer gets glibc's faster heap where there is room)."""
    from agentrl import heap
    from agentrl.launcher.placement import TrainerGroup

    monkeypatch.setattr(heap, "memory_limit_bytes", lambda: memory_gib * 2**30)
    ray = ray_init(RunConfig())
    cfg = RunConfig(name="malloc", trainer=overrides, resources={"trainer_world_size": 1, "trainer_num_cpus": 0.01})
    group = TrainerGroup(cfg, tmp_path, "redis://somewhere:6379/0", _fake_rank_class(ray))
    try:
        with caplog.at_level("INFO", logger="agentrl.launcher.placement"):
            await group.start()
        loaded, given = await asyncio.gather(group.actors[0].on_jemalloc.remote(),
                                             group.actors[0].malloc_given.remote())
    finally:
        group.kill()
    assert given == chosen and loaded == (chosen == "jemalloc")
    assert said in caplog.text


def test_the_trainer_actor_offers_its_nodes_address_and_a_free_port(tmp_path) -> None:
    import socket

    from agentrl.launcher.placement import _actor_classes

    ray = ray_init(RunConfig())
    actor = _actor_classes()[1].options(num_cpus=0.01).remote(RunConfig(), str(tmp_path), 0, None)
    try:
        address, port = ray.get(actor.rendezvous.remote(), timeout=120)
    finally:
        ray.kill(actor)
    assert address == ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((address, port))  # still free
    assert (tmp_path / "logs" / "trainer-0.log").exists()  # the actor made its node's logs/ itself


def test_the_process_groups_of_the_ledger_are_killed_by_a_task_on_the_recording_node(tmp_path) -> None:
    """The ledger is read where it was written: a task pinned to the rollout actor's node kills what it names."""
    import subprocess

    from agentrl.launcher.ledger import record_process
    from agentrl.launcher.placement import _kill_recorded_on

    ray = ray_init(RunConfig())
    sleeper = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        record_process(tmp_path, "sleeper", sleeper.pid)
        node = ray.put(ray.get_runtime_context().get_node_id())
        _kill_recorded_on(node, tmp_path)
        assert sleeper.wait(10) == -15  # SIGTERM, the first signal
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
