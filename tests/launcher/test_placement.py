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
