"""Fixtures of the evaluation tests: the real local sandbox and math-checker pool, as EnvResources."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from agentrl.env.registry import EnvResources
from agentrl.rewards import MathVerifier
from agentrl.sandbox.local import LocalSandbox


@pytest.fixture(scope="package")
async def resources() -> AsyncIterator[EnvResources]:
    async with LocalSandbox(max_concurrency=4) as sandbox, MathVerifier(workers=1) as verifier:
        yield EnvResources(sandbox=sandbox, verifier=verifier)
