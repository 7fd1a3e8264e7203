"""Fixtures of the launcher tests."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def shared_server(sglang_url: str, tiny_model_path: Path):
    """The session's SGLang server; these runs load their own weights into it, so the base weights are put back."""
    yield sglang_url
    from agentrl.engine.client import SGLangClient

    async def restore() -> None:
        async with SGLangClient(sglang_url) as client:
            await client.update_weights(str(tiny_model_path), 0)

    asyncio.run(restore())
