"""Helpers of the evaluation tests: a scripted engine (for the logic around the engine only; the real SGLang
runs are marked ``sglang``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agentrl.engine.base import EngineFinish, GenerateResult, SamplingParams
from agentrl.errors import EngineError

#: (seed, turn index) -> the text of that model turn; None: the engine fails (EngineError)
Script = Callable[[int, int], str | None]


@dataclass
class ScriptedEngine:
    """An InferenceEngine answering from a script keyed by the request's seed and the episode's turn (the
    number of ``</interpreter>`` observations in the input so far)."""

    tok: Any
    script: Script
    delay_s: float = 0.0
    calls: int = 0
    in_flight: int = 0
    max_in_flight: int = 0

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *,
                       sticky_key: str | None = None) -> GenerateResult:
        self.calls += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            turn = self.tok.decode(list(input_ids)).count("\n</interpreter>")  # tool answers so far = the turn
            text = self.script(sampling.seed or 0, turn)
            if text is None:
                raise EngineError("scripted engine failure")
            ids = self.tok.encode_text(text)
            if not text.endswith("</code>"):
                ids.append(self.tok.eos_token_id)
            return GenerateResult(ids, [-0.5] * len(ids), [0] * len(ids), EngineFinish.STOP)
        finally:
            self.in_flight -= 1

    async def update_weights(self, path: str, version: int) -> None: ...

    async def weight_version(self) -> int:
        return 0

    async def aclose(self) -> None: ...
