"""A scripted inference engine for the gateway's unit tests."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from agentrl.engine.base import EngineFinish, GenerateResult, SamplingParams
from agentrl.tokenizer import ChatTokenizer


class ScriptedEngine:
    """An InferenceEngine answering each request with the next preset text (+ EOS unless ``stop`` is given in the
    script as ``(text, "stop string")``); logprobs -0.01·(k+1) numbered over all tokens ever sent, version 3."""

    def __init__(self, tok: ChatTokenizer, replies: Sequence[str | tuple[str, str]], *, delay_s: float = 0.0):
        self.tok, self.replies, self.delay_s = tok, list(replies), delay_s
        self.prompts: list[list[int]] = []
        self.cancelled = 0
        self._n = 0

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *,
                       sticky_key: str | None = None) -> GenerateResult:
        self.prompts.append(list(input_ids))
        reply = self.replies.pop(0)
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        text, stop = (reply, reply[1]) if isinstance(reply, tuple) else (reply, None)
        text = text[0] if isinstance(text, tuple) else text
        ids = self.tok.encode_text(text) + ([] if stop else [self.tok.eos_token_id])
        ids = ids[: sampling.max_new_tokens]
        logprobs = [-0.01 * (self._n + k + 1) for k in range(len(ids))]
        self._n += len(ids)
        return GenerateResult(ids, logprobs, [3] * len(ids), EngineFinish.STOP, matched_stop=stop or self.tok.eos_token_id)

    async def update_weights(self, path: str, version: int) -> None: ...

    async def weight_version(self) -> int:
        return 3

    async def aclose(self) -> None: ...
