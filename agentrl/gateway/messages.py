"""Messages in the gateway's own form (OpenAI chat messages, content as text, tool-call arguments as dicts), from
either API, and their canonical keys.

A canonical key identifies a conversation prefix for bridging (:mod:`agentrl.gateway.session`): tool-call ids and
tool names of tool results are dropped (clients make them up), JSON arguments are normalised (sorted keys, no
spaces), a missing content equals an empty one and surrounding whitespace is ignored. The key of messages
``m[:k]`` chains the key of ``m[:k-1]`` with ``m[k-1]``, seeded with the tool list (a changed tool list never
bridges).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any


class MessageError(ValueError):
    """A request's messages cannot be read (answered with HTTP 400)."""


def text_of(content: Any, where: str) -> str:
    """A message content as text: a string, ``None``, or a list of text parts (OpenAI ``{"type": "text"}``,
    Anthropic text blocks); any other part is refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, Mapping) and part.get("type") in ("text", "input_text") and "text" in part:
                out.append(str(part["text"]))
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise MessageError(f"{where}: only text content is supported, got a {kind!r} part")
        return "".join(out)
    raise MessageError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")


def _arguments(value: Any) -> Any:
    """Tool-call arguments as a dict when they are a JSON object (string or dict), else as given."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value) if value.strip() else {}
        except ValueError:
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


def from_openai(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages in the gateway's form (``developer`` is a system message)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise MessageError(f"messages[{i}]: role must be system, developer, user, assistant or tool, got {role!r}")
        msg: dict[str, Any] = {"role": role, "content": text_of(m.get("content"), f"messages[{i}]")}
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = call.get("function") or {}
                calls.append({"id": call.get("id", ""), "type": "function",
                              "function": {"name": fn.get("name", ""), "arguments": _arguments(fn.get("arguments"))}})
            msg["tool_calls"] = calls
        if role == "tool" and m.get("tool_call_id"):
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def from_anthropic(system: Any, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic messages (+ ``system``) in the gateway's form: ``tool_use`` blocks become the assistant's
    ``tool_calls``, ``tool_result`` blocks become ``tool`` messages (before the user's text of the same turn)."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": text_of(system, "system")})
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise MessageError(f"messages[{i}]: role must be user or assistant, got {role!r}")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        texts, calls, results = [], [], []
        for b in blocks:
            kind = b.get("type")
            if kind == "text":
                texts.append(str(b.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": b.get("id", ""), "type": "function",
                              "function": {"name": b.get("name", ""), "arguments": _arguments(b.get("input", {}))}})
            elif kind == "tool_result" and role == "user":
                results.append({"role": "tool", "tool_call_id": b.get("tool_use_id", ""),
                                "content": text_of(b.get("content"), f"messages[{i}].tool_result")})
            elif kind in ("thinking", "redacted_thinking"):
                continue
            else:
                raise MessageError(f"messages[{i}]: a {kind!r} block is not supported in a {role} message")
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        else:
            out += results
            if texts or not results:
                out.append({"role": "user", "content": "".join(texts)})
    return out


def tools_from_anthropic(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic tool definitions as OpenAI function tools."""
    return [{"type": "function", "function": {
        "name": t["name"], "description": t.get("description", ""),
        "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}} for t in tools]


def _canonical(m: Mapping[str, Any]) -> str:
    calls = [[c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True, separators=(",", ":"),
                                                ensure_ascii=False)] for c in m.get("tool_calls") or ()]
    return json.dumps([m["role"], (m.get("content") or "").strip(), calls], ensure_ascii=False)


def prefix_keys(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = (), *,
                seed: str | None = None) -> list[str]:
    """``keys[k]`` is the canonical key of ``messages[:k]`` under ``tools`` (``len(messages) + 1`` keys); with
    ``seed`` (the key of earlier messages) the chain continues from there instead."""
    if seed is None:
        seed = hashlib.sha256(json.dumps(list(tools), sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    keys = [seed]
    for m in messages:
        keys.append(hashlib.sha256((keys[-1] + _canonical(m)).encode()).hexdigest())
    return keys
