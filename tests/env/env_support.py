"""A scripted engine for environment tests: returns given model turns as token ids (EOS added where asked)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.engine.base import EngineFinish, GenerateResult, SamplingParams


@dataclass
class ScriptedEngine:
    tok: Any
    turns: list[tuple[str, bool]]  # (text, ends with EOS)
    requests: list[list[int]] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *, sticky_key=None):
        self.requests.append(list(input_ids))
        text, eos = self.turns.pop(0)
        ids = self.tok.encode_text(text) + ([self.tok.eos_token_id] if eos else [])
        self.outputs.append(ids)
        return GenerateResult(ids, [-0.25] * len(ids), [0] * len(ids), EngineFinish.STOP)

    async def update_weights(self, path: str, version: int) -> None: ...
    async def weight_version(self) -> int:
        return 0
    async def aclose(self) -> None: ...
