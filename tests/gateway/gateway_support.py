"""Helpers of the gateway tests: a scripted inference engine for the unit tests; for the real-SGLang ones, what the
``gateway`` fixture serves (:class:`Served`) and the branch invariant checked against the engine's records."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentrl.engine.base import EngineFinish, GenerateResult, SamplingParams
from agentrl.gateway import SessionStore
from agentrl.tokenizer import ChatTokenizer


class ScriptedEngine:
    """An InferenceEngine answering each request with the next preset text (+ EOS unless ``stop`` is given in the
    script as ``(text, "stop string")``); logprobs -0.01·(k+1) numbered over all tokens ever sent, version 3."""

    def __init__(self, tok: ChatTokenizer, replies: Sequence[str | tuple[str, str]], *, delay_s: float = 0.0):
        self.tok, self.replies, self.delay_s = tok, list(replies), delay_s
        self.prompts: list[list[int]] = []
        self.samplings: list[SamplingParams] = []
        self.cancelled = 0
        self._n = 0

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *,
                       sticky_key: str | None = None) -> GenerateResult:
        self.prompts.append(list(input_ids))
        self.samplings.append(sampling)
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


class Served:
    """A gateway on a real uvicorn server: its URL, its sessions, the engine's records (one JSON line per
    ``generate``: input_ids, output_ids, logprobs, versions) and the JSON bodies of the chat requests it received."""

    def __init__(self, url: str, store: SessionStore, records: Path) -> None:
        self.url, self.store, self.records = url, store, records
        self.requests: list[dict[str, Any]] = []

    def generations(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.records.read_text().splitlines()]


class RequestTap:
    """ASGI middleware: appends the JSON body of every ``…/chat/completions`` or ``…/messages`` POST to ``into``."""

    def __init__(self, app: Any, into: list[dict[str, Any]]) -> None:
        self.app, self.into = app, into

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith(("/chat/completions", "/messages")):
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []

        async def tapped() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    self.into.append(json.loads(b"".join(chunks)))
            return message

        await self.app(scope, tapped, send)


def check_branch(branch: dict[str, Any], generations: list[dict[str, Any]]) -> None:
    """Each generation's prompt is the branch's prefix, followed by exactly the ids SGLang returned, mask 1, with
    exactly its logprobs and versions; every other token is mask 0."""
    scored = set()
    for g in generations:
        start, end = len(g["input_ids"]), len(g["input_ids"]) + len(g["output_ids"])
        assert branch["token_ids"][:start] == g["input_ids"]
        assert branch["token_ids"][start:end] == g["output_ids"]
        assert branch["loss_mask"][start:end] == [1] * (end - start)
        assert branch["logprobs"][start:end] == g["logprobs"]
        assert branch["weight_versions"][start:end] == g["versions"]
        scored |= set(range(start, end))
    assert {i for i, m in enumerate(branch["loss_mask"]) if m} == scored
