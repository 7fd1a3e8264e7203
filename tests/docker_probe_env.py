"""An environment for tests/test_docker_e2e.py (``agentrl serve --import`` loads it): whatever the model writes,
its score runs one program in the service's sandbox that says whether it ran inside a Docker container (the engine
puts ``/.dockerenv`` in every container; the host has none), and scores 1 if it did. The tiny random model cannot be
relied on to write code; this makes every episode of an evaluation use the sandbox."""

from __future__ import annotations

import asyncio
from typing import Any

import agentrl
from agentrl.env.base import SingleTurnEnv
from agentrl.rewards import RewardInput, RewardResult
from agentrl.sandbox.base import Limits, RunRequest
from agentrl.types import Task

PROBE = "import os\nprint(os.path.exists('/.dockerenv'))"


@agentrl.register_env("docker_probe")
class DockerProbeEnv(SingleTurnEnv):
    """Scores 1 when the sandbox that runs the probe is a Docker container."""

    name = "docker_probe"
    system_prompt = "Say anything."

    def __init__(self, resources: Any, **options: Any) -> None:
        self.sandbox = resources.sandbox
        self.reward = self._probe

    async def _probe(self, task: Task, response: RewardInput) -> RewardResult:
        async with asyncio.timeout(120):
            result = await self.sandbox.run(RunRequest(code=PROBE, limits=Limits(time_s=10)))
        if result.is_sandbox_error:
            return RewardResult.infra_error(result.message)
        return RewardResult.scored(float(result.stdout.strip() == "True"), stdout=result.stdout)
