"""Turning chat messages and observations into token ids, once, without re-tokenising what came before.

The prompt is rendered with the chat template and tokenised once. Later pieces are tokenised on their own and
appended: raw observation text (ReTool) as is, tool-role messages as the chat template's *delta* — the text the
template adds after a finished assistant message — so the sequence is exactly what the model saw.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError

_BASE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]


class ChatTokenizer:
    """A Hugging Face tokenizer with the few operations an episode needs."""

    def __init__(self, tokenizer: Any) -> None:
        self.hf = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("the tokenizer has no chat template; agentrl renders prompts with it")
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ConfigError("the tokenizer has no eos_token_id")
        self.eos_token_id = int(eos)
        self.eos_token = tokenizer.convert_ids_to_tokens(self.eos_token_id)
        base = self.render(_BASE, add_generation_prompt=False)
        cut = base.rfind(self.eos_token)
        if cut < 0:
            raise ConfigError("the chat template does not end an assistant message with the EOS token")
        self._base_text = base[: cut + len(self.eos_token)]

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ChatTokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path)))

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        return str(self.hf.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools or None
        ))

    def encode_prompt(self, messages: Sequence[Mapping[str, Any]],
                      tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        return self.encode_text(self.render(messages, add_generation_prompt=True, tools=tools))

    def encode_text(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def encode_messages_delta(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Tokens the chat template adds for ``messages`` after an assistant message that ended with EOS,
        including the next assistant header."""
        full = self.render([*_BASE, *messages], add_generation_prompt=True)
        if not full.startswith(self._base_text):
            raise ConfigError("the chat template re-renders earlier turns differently; cannot append tool turns")
        return self.encode_text(full[len(self._base_text):])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=False))


def tokenize_trace(tok: ChatTokenizer, messages: Sequence[Mapping[str, Any]],
                   parts: Sequence[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of a supervised trace: the prompt (mask 0), then each (text, is_model) part
    tokenised on its own (mask 1 for the model's parts, 0 for observations), then EOS (mask 1).

    Tokenising part by part gives the same token boundaries the rollout produces (where the model's turn stops
    at a tool tag and the observation is appended as its own tokens)."""
    ids = tok.encode_prompt(messages)
    mask = [0] * len(ids)
    for text, is_model in parts:
        piece = tok.encode_text(text)
        ids += piece
        mask += [int(is_model)] * len(piece)
    ids.append(tok.eos_token_id)
    mask.append(1)
    return ids, mask
