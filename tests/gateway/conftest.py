"""Fixtures of the gateway tests: chat tokenizers with real templates (SmolLM2's; a Qwen2.5 one and a
thinking-stripping one from ``templates/``, on SmolLM2's tokenizer, which has the ChatML tokens); ``gateway``, the
whole gateway on a real uvicorn server in front of the shared SGLang server."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from gateway_support import RequestTap, Served

from agentrl.tokenizer import ChatTokenizer

TEMPLATES = Path(__file__).parent / "templates"


def _with_template(path: Path, name: str) -> ChatTokenizer:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(path))
    hf.chat_template = (TEMPLATES / name).read_text()
    return ChatTokenizer(hf)


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> ChatTokenizer:
    from agentrl.models import resolve_model

    return ChatTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def qwen25_tokenizer(tiny_model_path: Path) -> ChatTokenizer:
    return _with_template(tiny_model_path, "qwen25.jinja")


@pytest.fixture(scope="session")
def thinking_tokenizer(tiny_model_path: Path) -> ChatTokenizer:
    return _with_template(tiny_model_path, "thinking.jinja")


@pytest.fixture
async def gateway(sglang_url: str, chat_tokenizer: ChatTokenizer, tmp_path: Path) -> AsyncIterator[Served]:
    """The gateway (model name ``tiny``, builtin tool parser) on the shared SGLang server, each ``generate``
    recorded, each chat request's body kept."""
    import uvicorn

    from agentrl.engine.client import SGLangClient
    from agentrl.engine.recording import RecordingEngine
    from agentrl.gateway import Gateway, GatewayConfig, SessionStore, create_app

    records = tmp_path / "generate.jsonl"
    engine = RecordingEngine(SGLangClient(sglang_url), records)
    store = SessionStore()
    app = create_app(Gateway(engine, chat_tokenizer, GatewayConfig(model_name="tiny")), store)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    served = Served(f"http://127.0.0.1:{port}", store, records)
    server = uvicorn.Server(uvicorn.Config(RequestTap(app, served.requests), host="127.0.0.1", port=port,
                                           log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    try:
        yield served
    finally:
        server.should_exit = True
        await task
        await engine.inner.aclose()
        await engine.aclose()
