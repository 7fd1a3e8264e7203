"""The local Ray cluster the driver starts runs our actors at the driver's CPU priority, not Ray's nice 15."""

from __future__ import annotations

import os

from agentrl.launcher import driver
from agentrl.launcher.config import RunConfig


def test_actors_of_the_local_cluster_run_at_the_drivers_priority() -> None:
    ray = driver._ray_init(RunConfig())

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    # Ray's default (RAY_worker_niceness 15) would put the trainer, SGLang and the sandboxes behind any other
    # process on the machine
    assert ray.get(niceness.remote(), timeout=120) == os.nice(0)
