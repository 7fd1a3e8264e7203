"""Fixtures of the gateway tests: chat tokenizers with real templates (SmolLM2's; a Qwen2.5 one and a
thinking-stripping one from ``templates/``, on SmolLM2's tokenizer, which has the ChatML tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest

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
