"""The Anthropic messages wire format: the request model, and the answer as JSON or as SSE events
(``message_start`` … ``message_stop``) synthesized after generation."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agentrl.gateway.base import ChatCall, Completion
from agentrl.gateway.messages import MessageError, from_anthropic, tools_from_anthropic

_STOP = {"tool_calls": "tool_use", "length": "max_tokens"}


class MessagesRequest(BaseModel):
    """``POST /v1/messages``; fields the gateway does not use are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str = ""
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    max_tokens: int = Field(ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stop_sequences: list[str] | None = None
    regex: str | None = None  # SGLang's constrained decoding (extra_body)
    ebnf: str | None = None

    def to_call(self) -> ChatCall:
        tools = [t for t in self.tools or [] if "name" in t]  # server tools (web search, …) have no schema here
        if any(not isinstance(t.get("name"), str) for t in tools):
            raise MessageError("each tool must have a string name")
        kind = (self.tool_choice or {}).get("type", "auto")
        choice = {"auto": "auto", "none": "none", "any": "required"}.get(kind) or (
            (self.tool_choice or {}).get("name") if kind == "tool" else None)
        if not isinstance(choice, str) or not choice:
            raise MessageError('tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
                               f'{{"type": "tool", "name": …}}, got {self.tool_choice!r}')
        return ChatCall(messages=from_anthropic(self.system, self.messages), tools=tools_from_anthropic(tools),
                        tool_choice=choice, max_tokens=self.max_tokens,
                        temperature=1.0 if self.temperature is None else self.temperature,
                        top_p=1.0 if self.top_p is None else self.top_p, stop=tuple(self.stop_sequences or ()),
                        regex=self.regex, ebnf=self.ebnf)


def _blocks(c: Completion) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": c.content}] if c.content or not c.tool_calls else []
    blocks += [{"type": "tool_use", "id": t.id.replace("call_", "toolu_", 1), "name": t.name,
                "input": dict(t.arguments)} for t in c.tool_calls]
    return blocks


def _stop_reason(c: Completion) -> str:
    return _STOP.get(c.finish_reason) or ("stop_sequence" if c.matched_stop else "end_turn")


def message_json(c: Completion, model: str) -> dict[str, Any]:
    return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": model,
            "content": _blocks(c), "stop_reason": _stop_reason(c), "stop_sequence": c.matched_stop,
            "usage": {"input_tokens": c.prompt_tokens, "output_tokens": c.completion_tokens}}


def message_sse(c: Completion, model: str) -> Iterator[str]:
    """The answer as Anthropic's stream events, one content block at a time."""

    def event(kind: str, data: dict[str, Any]) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    full = message_json(c, model)
    start = {**full, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": c.prompt_tokens, "output_tokens": 0}}
    yield event("message_start", {"message": start})
    for i, block in enumerate(full["content"]):
        if block["type"] == "text":
            yield event("content_block_start", {"index": i, "content_block": {"type": "text", "text": ""}})
            yield event("content_block_delta", {"index": i, "delta": {"type": "text_delta", "text": block["text"]}})
        else:
            yield event("content_block_start", {"index": i, "content_block": {**block, "input": {}}})
            yield event("content_block_delta", {"index": i, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}})
        yield event("content_block_stop", {"index": i})
    yield event("message_delta", {"delta": {"stop_reason": full["stop_reason"], "stop_sequence": c.matched_stop},
                                  "usage": {"output_tokens": c.completion_tokens}})
    yield event("message_stop", {})
