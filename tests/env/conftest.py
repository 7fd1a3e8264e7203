"""Fixtures of the environment tests: the real local sandbox and math checker pool, shared per module."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from agentrl.env.registry import EnvResources
from agentrl.rewards import MathVerifier
from agentrl.sandbox import make_sandbox


@pytest.fixture(scope="module")
async def env_resources() -> AsyncIterator[EnvResources]:
    sandbox = make_sandbox("local", max_concurrency=4)
    verifier = MathVerifier(workers=1)
    await verifier.start()
    try:
        yield EnvResources(sandbox=sandbox, verifier=verifier)
    finally:
        await verifier.aclose()
        await sandbox.aclose()
