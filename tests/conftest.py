"""Shared fixtures: ONE SGLang server (tiny model) and ONE embedded Redis per test session.

Tests that need them are marked ``sglang`` / ``redis``; both start lazily, on first use, and are stopped at the
end of the session.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from agentrl.models import resolve_model

    return resolve_model("tiny")


@pytest.fixture(scope="session")
def chat_tokenizer(tiny_model_path: Path):
    from agentrl.tokenizer import ChatTokenizer

    return ChatTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def sglang_url(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real SGLang server on CPU serving the ``tiny`` model (shared by the whole session)."""
    from agentrl.engine.server import SGLangServer, SGLangServerConfig

    log = tmp_path_factory.mktemp("sglang") / "sglang.log"
    server = SGLangServer(SGLangServerConfig(model_path=str(tiny_model_path), max_total_tokens=16384,
                                                 dtype="float32"), log_path=log)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()
