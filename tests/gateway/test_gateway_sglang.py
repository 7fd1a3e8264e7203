"""The whole gateway path on the shared real SGLang server (tiny random model, SmolLM2's tokenizer and template),
through a real uvicorn server, driven by the official ``openai`` and ``anthropic`` clients. The random model
calls no tool by itself: tool-call turns are forced with SGLang's constrained decoding (``extra_body={"regex":
…}``, passed through like SGLang's own OpenAI server does), the other turns sample freely."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
from gateway_support import Served, check_branch

pytestmark = pytest.mark.sglang

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
FORCE_CALL = r'<tool_call>\n\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}\n</tool_call>'
MESSAGES = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "2+3?"}]


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_client_multi_turn_tool_calls_make_one_exact_branch(gateway: Served, stream: bool) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        created = (await http.post(f"{gateway.url}/sessions")).json()
        client = openai.AsyncOpenAI(base_url=created["base_url"], api_key=created["api_key"], max_retries=0)
        messages = list(MESSAGES)
        for _ in range(2):
            kwargs: dict[str, Any] = dict(model="tiny", messages=messages, tools=TOOLS, max_tokens=64,
                                          extra_body={"regex": FORCE_CALL})
            if stream:
                chunks = [c async for c in await client.chat.completions.create(**kwargs, stream=True)]
                calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
                finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
                call_id, name, arguments = calls[0].id, calls[0].function.name, calls[0].function.arguments
            else:
                choice = (await client.chat.completions.create(**kwargs)).choices[0]
                finish = [choice.finish_reason]
                call = choice.message.tool_calls[0]
                call_id, name, arguments = call.id, call.function.name, call.function.arguments
            assert finish == ["tool_calls"] and name == "add" and call_id.startswith("call_")
            args = json.loads(arguments)
            assert set(args) == {"a", "b"}
            messages += [{"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": call_id, "content": str(args["a"] + args["b"])}]
        final = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=8)
        assert final.usage.completion_tokens == len(gateway.generations()[-1]["output_ids"])
        await http.post(f"{created['base_url'][:-3]}/reward", json={"reward": 0.5, "finished": True})
        out = (await http.post(f"{created['base_url'][:-3]}/finalize")).json()
    assert out["reward"] == 0.5 and len(out["branches"]) == 1
    branch = out["branches"][0]
    assert [t["bridged"] for t in branch["turns"]] == [False, True, True]
    check_branch(branch, gateway.generations())


async def test_anthropic_client_tool_use_round_trip(gateway: Served) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        created = (await http.post(f"{gateway.url}/sessions")).json()
    client = anthropic.AsyncAnthropic(base_url=created["anthropic_base_url"], api_key=created["api_key"],
                                      max_retries=0)
    tools = [{"name": "add", "description": "Add two integers.", "input_schema": TOOLS[0]["function"]["parameters"]}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "2+3?"}]
    async with client.messages.stream(model="tiny", max_tokens=64, system="Use the tools.", messages=messages,
                                      tools=tools, extra_body={"regex": FORCE_CALL}) as s:
        first = await s.get_final_message()
    use = first.content[-1]
    assert first.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "add"
    assert use.id.startswith("toolu_") and set(use.input) == {"a", "b"}
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
    second = await client.messages.create(model="tiny", max_tokens=8, system="Use the tools.", messages=messages,
                                          tools=tools)
    assert second.stop_reason in ("end_turn", "max_tokens")
    session = gateway.store.get(created["id"])
    assert len(session.branches) == 1 and session.branches[0].turns[1].bridged
    check_branch(session.branches[0].to_json(), gateway.generations())


async def test_a_client_that_disconnects_aborts_its_generation(gateway: Served) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        created = (await http.post(f"{gateway.url}/sessions")).json()
        with pytest.raises(httpx.ReadTimeout):
            await http.post(f"{created['base_url']}/chat/completions", timeout=0.5, json={
                "model": "tiny", "messages": MESSAGES, "max_tokens": 4000, "regex": "(ab){2000}"})
        session = gateway.store.get(created["id"])
        for _ in range(100):
            if not session.inflight:
                break
            await asyncio.sleep(0.05)
        assert not session.inflight and session.branches == []  # cancelled, nothing committed
        ok = await http.post(f"{created['base_url']}/chat/completions",
                             json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4})
        assert ok.status_code == 200 and len(session.branches) == 1
