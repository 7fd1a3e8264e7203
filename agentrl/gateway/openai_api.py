"""The OpenAI chat-completions wire format: the request model, and the answer as JSON or as SSE chunks
synthesized after generation (the whole answer is known by then)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agentrl.gateway.base import ChatCall, Completion
from agentrl.gateway.messages import MessageError, from_openai
from agentrl.gateway.tool_choice import SUPPORTED


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions``; fields the gateway does not use are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str = ""
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    n: int = 1
    seed: int | None = None
    regex: str | None = None  # SGLang's constrained decoding (extra_body), as its own OpenAI server takes it
    ebnf: str | None = None

    def to_call(self) -> ChatCall:
        if self.n != 1:
            raise MessageError(f"n must be 1 (one sample per request; send more requests for more), got {self.n}")
        tools = [t for t in self.tools or [] if t.get("type", "function") == "function"]
        for t in tools:
            if not isinstance(t.get("function"), dict) or not t["function"].get("name"):
                raise MessageError('each tool must be {"type": "function", "function": {"name": ..., ...}}')
        choice: Any = self.tool_choice or "auto"
        if isinstance(choice, dict):  # {"type": "function", "function": {"name": ...}}
            choice = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(choice, str) or not choice:
            raise MessageError(f"tool_choice must be {SUPPORTED}, got {self.tool_choice!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return ChatCall(messages=from_openai(self.messages), tools=tools, tool_choice=choice,
                        max_tokens=self.max_completion_tokens or self.max_tokens,
                        temperature=1.0 if self.temperature is None else self.temperature,
                        top_p=1.0 if self.top_p is None else self.top_p, stop=stop, regex=self.regex, ebnf=self.ebnf,
                        seed=self.seed)


def _message(c: Completion) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": c.content or (None if c.tool_calls else "")}
    if c.tool_calls:
        msg["tool_calls"] = [{"id": t.id, "type": "function", "function": {
            "name": t.name, "arguments": json.dumps(t.arguments, ensure_ascii=False)}} for t in c.tool_calls]
    return msg


def _usage(c: Completion) -> dict[str, int]:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens}


def completion_json(c: Completion, model: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": _message(c), "finish_reason": c.finish_reason,
                                         "logprobs": None}],
            "usage": _usage(c)}


def completion_sse(c: Completion, model: str, *, include_usage: bool) -> Iterator[str]:
    """The answer as ``chat.completion.chunk`` events: role, content, one chunk per tool call, finish, [usage]."""
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return f"data: {json.dumps({**head, 'choices': [{'index': 0, 'delta': delta, 'finish_reason': finish}]})}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if c.content:
        yield chunk({"content": c.content})
    for i, t in enumerate(c.tool_calls):
        yield chunk({"tool_calls": [{"index": i, "id": t.id, "type": "function", "function": {
            "name": t.name, "arguments": json.dumps(t.arguments, ensure_ascii=False)}}]})
    yield chunk({}, c.finish_reason)
    if include_usage:
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(c)})}\n\n"
    yield "data: [DONE]\n\n"


def models_json(model: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "agentrl"}]}
