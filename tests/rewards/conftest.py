"""Fixtures for the reward tests: a real MathVerifier pool, the real local sandbox, and fake sandboxes that
fail in the ways infrastructure fails (for the logic around the sandbox only)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from agentrl.rewards import MathVerifier
from agentrl.sandbox.base import Limits, RequestStatus, RunRequest, RunResult, Session


@pytest.fixture(scope="module")
async def verifier() -> AsyncIterator[MathVerifier]:
    async with MathVerifier(workers=2, timeout_s=5.0) as pool:
        yield pool


@pytest.fixture(scope="module")
async def local_sandbox() -> AsyncIterator[object]:
    try:
        from agentrl.sandbox.local import LocalSandbox
    except ImportError as exc:
        pytest.skip(f"agentrl.sandbox.local cannot be imported ({exc}); the real-sandbox code tests need it")
    async with LocalSandbox() as sandbox:
        yield sandbox


class FakeSandbox:
    """Answers each run with the next scripted behaviour: a RunResult, an exception, or "hang"."""

    def __init__(self, *script: RunResult | BaseException | str) -> None:
        self.script = list(script)
        self.requests: list[RunRequest] = []

    async def run(self, request: RunRequest) -> RunResult:
        self.requests.append(request)
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if step == "hang":
            await asyncio.sleep(3600)
        if isinstance(step, BaseException):
            raise step
        assert isinstance(step, RunResult)
        return step

    async def session(self, language: str = "python", limits: Limits | None = None) -> Session:
        raise NotImplementedError

    async def aclose(self) -> None:
        pass


@pytest.fixture
def fake_sandbox() -> type[FakeSandbox]:
    return FakeSandbox


@pytest.fixture
def sandbox_down() -> RunResult:
    """What a backend returns when it could not run the program at all."""
    return RunResult(
        status=RequestStatus.SANDBOX_ERROR, run_status=None, message="bwrap: setting up uid map failed"
    )
