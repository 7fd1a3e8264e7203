"""The gateway's HTTP routes driven by the official ``openai`` and ``anthropic`` clients (in process, through
``httpx.ASGITransport``, with a scripted engine): wire formats, tool-call round trips, streaming, the control
routes and the error statuses. The same path on a real SGLang server is tests/gateway/test_gateway_sglang.py."""

from __future__ import annotations

import json

import anthropic
import httpx
import httpx2  # the anthropic SDK's own httpx fork: its client must be one of these
import openai
import pytest
from gateway_support import ScriptedEngine

from agentrl.gateway import Gateway, GatewayConfig, SessionStore, create_app
from agentrl.tokenizer import hermes_call_text

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
MESSAGES = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "2+3?"}]


def _serve(tok, replies: list) -> tuple[httpx.AsyncClient, SessionStore, ScriptedEngine]:
    engine = ScriptedEngine(tok, replies)
    store = SessionStore()
    app = create_app(Gateway(engine, tok, GatewayConfig(model_name="tiny")), store, public_url="http://gw")
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
    http.anthropic = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gw")
    return http, store, engine


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_client_tool_calling_round_trip(smollm2_tokenizer, stream: bool) -> None:
    http, store, engine = _serve(smollm2_tokenizer, [hermes_call_text("add", {"a": 2, "b": 3}), "It is 5."])
    created = (await http.post("/sessions", json={"metadata": {"task": "t1"}})).json()
    assert created["base_url"] == f"http://gw/sessions/{created['id']}/v1"
    client = openai.AsyncOpenAI(base_url=created["base_url"], api_key=created["api_key"], http_client=http)
    assert [m.id async for m in client.models.list()] == ["tiny"]

    async def ask(messages):
        if not stream:
            return (await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)).choices[0]
        chunks = [c async for c in await client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, stream=True, stream_options={"include_usage": True})]
        assert chunks[-1].usage.completion_tokens > 0
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
        finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
        return type("Choice", (), {"message": type("M", (), {"content": content, "tool_calls": calls})(),
                                   "finish_reason": finish})()

    first = await ask(MESSAGES)
    assert first.finish_reason == "tool_calls"
    call = first.message.tool_calls[0]
    assert call.id.startswith("call_") and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    follow = [*MESSAGES, {"role": "assistant", "content": first.message.content or None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "add", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    second = await ask(follow)
    assert second.message.content == "It is 5." and second.finish_reason == "stop"
    posted = await http.post(f"/sessions/{created['id']}/reward", json={"reward": 1.0, "finished": True})
    assert posted.json()["reward"] == 1.0
    out = (await http.post(f"/sessions/{created['id']}/finalize")).json()
    assert out["reward"] == 1.0 and out["metadata"] == {"task": "t1"} and len(out["branches"]) == 1
    branch = out["branches"][0]
    assert [t["bridged"] for t in branch["turns"]] == [False, True]
    assert branch["token_ids"][: len(engine.prompts[-1])] == engine.prompts[-1]
    assert len(branch["token_ids"]) == len(branch["loss_mask"]) == len(branch["logprobs"])
    assert (await http.post(f"/sessions/{created['id']}/finalize")).status_code == 404


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_client_tool_use_round_trip(smollm2_tokenizer, stream: bool) -> None:
    http, store, engine = _serve(smollm2_tokenizer, ["Let me add." + hermes_call_text("add", {"a": 2, "b": 3}),
                                                     "It is 5."])
    created = (await http.post("/sessions")).json()
    client = anthropic.AsyncAnthropic(base_url=created["anthropic_base_url"], api_key=created["api_key"],
                                      http_client=http.anthropic)
    tools = [{"name": "add", "description": "Add two integers.", "input_schema": TOOLS[0]["function"]["parameters"]}]
    messages = [{"role": "user", "content": "2+3?"}]

    async def ask(msgs):
        if not stream:
            return await client.messages.create(model="tiny", max_tokens=64, system="Use the tools.",
                                                messages=msgs, tools=tools)
        async with client.messages.stream(model="tiny", max_tokens=64, system="Use the tools.", messages=msgs,
                                          tools=tools) as s:
            return await s.get_final_message()

    first = await ask(messages)
    assert first.stop_reason == "tool_use"
    text, use = first.content
    assert text.text == "Let me add." and use.name == "add" and use.input == {"a": 2, "b": 3}
    assert use.id.startswith("toolu_")
    msgs = [*messages, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
    second = await ask(msgs)
    assert second.content[0].text == "It is 5." and second.stop_reason == "end_turn"
    assert second.usage.output_tokens > 0
    out = (await http.post(f"/sessions/{created['id']}/finalize")).json()
    assert len(out["branches"]) == 1 and out["branches"][0]["turns"][1]["bridged"]


async def test_bare_routes_take_the_session_from_the_key(smollm2_tokenizer) -> None:
    http, store, engine = _serve(smollm2_tokenizer, ["hi", "there"])
    created = (await http.post("/sessions")).json()
    client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key=created["api_key"], http_client=http)
    assert (await client.chat.completions.create(model="x", messages=MESSAGES)).choices[0].message.content == "hi"
    ant = anthropic.AsyncAnthropic(base_url="http://gw", api_key=created["api_key"], http_client=http.anthropic)
    msg = await ant.messages.create(model="x", max_tokens=8, messages=[{"role": "user", "content": "yo"}])
    assert msg.content[0].text == "there"
    assert store.get(created["id"]).requests == 2
    wrong = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="sk-nope", http_client=http, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await wrong.chat.completions.create(model="x", messages=MESSAGES)


async def test_error_statuses(smollm2_tokenizer) -> None:
    http, store, engine = _serve(smollm2_tokenizer, [])
    created = (await http.post("/sessions")).json()
    client = openai.AsyncOpenAI(base_url=created["base_url"], api_key="k", http_client=http, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        await client.chat.completions.create(model="x", messages=MESSAGES, n=2)
    with pytest.raises(openai.BadRequestError, match="only text content"):
        await client.chat.completions.create(model="x", messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}])
    assert (await http.post(f"/sessions/{created['id']}/abort")).json()["aborted"]
    missing = openai.AsyncOpenAI(base_url="http://gw/sessions/nope/v1", api_key="k", http_client=http, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        await missing.chat.completions.create(model="x", messages=MESSAGES)


async def test_control_routes_need_the_token_when_one_is_set(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    app = create_app(Gateway(ScriptedEngine(tok, []), tok), SessionStore(), token="s3cret")
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
    assert (await http.post("/sessions")).status_code == 401
    assert (await http.post("/sessions", headers={"Authorization": "Bearer s3cret"})).status_code == 200


async def test_an_sdk_retry_over_http_is_replayed_not_sampled_again(smollm2_tokenizer) -> None:
    http, store, engine = _serve(smollm2_tokenizer, ["one", "two"])
    created = (await http.post("/sessions")).json()
    url = f"/sessions/{created['id']}/v1/chat/completions"
    body = {"model": "tiny", "messages": MESSAGES}
    first = (await http.post(url, json=body)).json()
    retried = (await http.post(url, json=body, headers={"x-stainless-retry-count": "1"})).json()
    assert first["choices"][0]["message"]["content"] == "one"
    assert (retried["choices"], retried["usage"]) == (first["choices"], first["usage"])
    assert len(engine.prompts) == 1 and store.get(created["id"]).replayed == 1
    again = (await http.post(url, json=body)).json()  # the same body without the header: a new sample
    assert again["choices"][0]["message"]["content"] == "two" and len(engine.prompts) == 2
    assert len(store.get(created["id"]).branches) == 2  # two samples of one prompt: a fork after the prompt
