"""The whole gateway path on the shared real SGLang server (tiny random model, SmolLM2's tokenizer and template),
through a real uvicorn server, driven by the official ``openai`` and ``anthropic`` clients. The random model
calls no tool by itself: tool-call turns are forced with SGLang's constrained decoding (``extra_body={"regex":
…}``, passed through like SGLang's own OpenAI server does), the other turns sample freely."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import anthropic
import httpx
import openai
import pytest
from gateway_support import Served, check_branch

from agentrl.tokenizer import ChatTokenizer

pytestmark = pytest.mark.sglang

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
FORCE_CALL = r'<tool_call>\n\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}\n</tool_call>'
MESSAGES = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "2+3?"}]


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_client_multi_turn_tool_calls_make_one_exact_branch(gateway: Served, stream: bool,
                                                                        chat_tokenizer: ChatTokenizer) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        created = (await http.post(f"{gateway.url}/sessions")).json()
        client = openai.AsyncOpenAI(base_url=created["base_url"], api_key=created["api_key"], max_retries=0)
        messages = list(MESSAGES)
        for _ in range(2):
            kwargs: dict[str, Any] = dict(model="tiny", messages=messages, tools=TOOLS, max_tokens=128,
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
            assert args == _sampled_call(chat_tokenizer, gateway)  # the arguments are what the model sampled
            messages += [{"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": call_id, "content": str(args["a"] + args["b"])}]
        final = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=8)
        sent = [m["tool_calls"][0] for m in gateway.requests[-1]["messages"] if m.get("tool_calls")]
        assert [c["id"] for c in sent] == [m["tool_call_id"] for m in messages if m["role"] == "tool"]
        assert final.usage.completion_tokens == len(gateway.generations()[-1]["output_ids"])
        await http.post(f"{created['base_url'][:-3]}/reward", json={"reward": 0.5, "finished": True})
        out = (await http.post(f"{created['base_url'][:-3]}/finalize")).json()
    assert out["reward"] == 0.5 and len(out["branches"]) == 1
    branch = out["branches"][0]
    assert [t["bridged"] for t in branch["turns"]] == [False, True, True]
    check_branch(branch, gateway.generations())


async def test_anthropic_client_tool_use_round_trip(gateway: Served, chat_tokenizer: ChatTokenizer) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        created = (await http.post(f"{gateway.url}/sessions")).json()
    client = anthropic.AsyncAnthropic(base_url=created["anthropic_base_url"], api_key=created["api_key"],
                                      max_retries=0)
    tools = [{"name": "add", "description": "Add two integers.", "input_schema": TOOLS[0]["function"]["parameters"]}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "2+3?"}]
    async with client.messages.stream(model="tiny", max_tokens=128, system="Use the tools.", messages=messages,
                                      tools=tools, extra_body={"regex": FORCE_CALL}) as s:
        first = await s.get_final_message()
    use = first.content[-1]
    assert first.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "add"
    assert use.id.startswith("toolu_") and use.input == _sampled_call(chat_tokenizer, gateway)
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
    second = await client.messages.create(model="tiny", max_tokens=8, system="Use the tools.", messages=messages,
                                          tools=tools)
    assert second.stop_reason in ("end_turn", "max_tokens")
    # the toolu_ id came back on both blocks as the client received it
    sent = gateway.requests[-1]["messages"]
    assert [b["id"] for b in sent[1]["content"] if b["type"] == "tool_use"] == [use.id]
    assert sent[2]["content"][0]["tool_use_id"] == use.id
    session = gateway.store.get(created["id"])
    assert len(session.branches) == 1 and session.branches[0].turns[1].bridged
    async with httpx.AsyncClient(timeout=30) as http:
        posted = await http.post(f"{created['anthropic_base_url']}/reward", json={"reward": 0.25, "finished": True,
                                                                                   "metrics": {"calls": 1.0}})
        assert posted.json() == {"id": created["id"], "reward": 0.25, "finished": True}
        out = (await http.post(f"{created['anthropic_base_url']}/finalize")).json()
    assert out["reward"] == 0.25 and out["finished"] and out["metrics"] == {"calls": 1.0}
    assert len(out["branches"]) == 1
    check_branch(out["branches"][0], gateway.generations())


@pytest.mark.parametrize("choice", ["required", "named"])
async def test_tool_choice_is_enforced_by_the_grammar(gateway: Served, chat_tokenizer: ChatTokenizer,
                                                      choice: str) -> None:
    # tools without arguments: the grammar leaves the random model no free text, so its calls always close
    # (with arguments, it may write one string value for ever)
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
             for n in ("now", "mul")]
    tool_choice: Any = "required" if choice == "required" else {"type": "function", "function": {"name": "mul"}}
    async with httpx.AsyncClient(timeout=120) as http:
        created = (await http.post(f"{gateway.url}/sessions")).json()
    client = openai.AsyncOpenAI(base_url=created["base_url"], api_key=created["api_key"], max_retries=0)
    done = await client.chat.completions.create(model="tiny", messages=MESSAGES, tools=tools,
                                                tool_choice=tool_choice, max_tokens=200)
    sampled = chat_tokenizer.decode(gateway.generations()[-1]["output_ids"])
    blocks = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", sampled)
    assert blocks and sampled.startswith("<tool_call>\n"), sampled
    assert all(json.loads(b)["name"] in ("now", "mul") and json.loads(b)["arguments"] == {} for b in blocks)
    if choice == "named":  # exactly one call of that function, then the end of the turn
        assert done.choices[0].finish_reason == "tool_calls", sampled
        assert [(c.function.name, c.function.arguments) for c in done.choices[0].message.tool_calls] == [("mul", "{}")]
    elif done.choices[0].finish_reason == "tool_calls":  # required: one or more calls (it may chain them past 200)
        assert [c.function.name for c in done.choices[0].message.tool_calls] == [json.loads(b)["name"] for b in blocks]
    else:
        assert done.choices[0].finish_reason == "length", sampled


async def test_a_client_that_disconnects_aborts_its_generation(gateway: Served, sglang_url: str) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        created = (await http.post(f"{gateway.url}/sessions")).json()
        # up to 8000 free tokens of the random model (EOS is rare), ~80 s here: far longer than the wait
        # below, so only an abort ends it in time (the gateway's engine client aborts the rid, tested in
        # tests/engine/test_client_timeouts.py; SGLang also stops a request whose HTTP connection closed)
        request = asyncio.ensure_future(http.post(f"{created['base_url']}/chat/completions", json={
            "model": "tiny", "messages": MESSAGES, "max_tokens": 8000}))
        await _until(lambda n: n > 0, http, sglang_url, "the generation never started on SGLang")
        request.cancel()  # the client goes away mid-generation
        with pytest.raises(asyncio.CancelledError):
            await request
        await _until(lambda n: n == 0, http, sglang_url, "SGLang still runs the request the client abandoned",
                     deadline_s=10)
        session = gateway.store.get(created["id"])
        async with asyncio.timeout(10):
            while session.inflight:
                await asyncio.sleep(0.05)
        assert session.branches == []  # cancelled, nothing committed
        ok = await http.post(f"{created['base_url']}/chat/completions",
                             json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4})
        assert ok.status_code == 200 and len(session.branches) == 1


async def _until(ok: Any, http: httpx.AsyncClient, sglang_url: str, what: str, *, deadline_s: float = 60) -> None:
    """Poll SGLang's load (``GET /v1/loads``: running + waiting requests) until ``ok(count)``, or fail saying
    ``what`` after ``deadline_s``."""
    count = -1
    try:
        async with asyncio.timeout(deadline_s):
            while True:
                core = (await http.get(f"{sglang_url}/v1/loads", params={"include": "core"})).json()["loads"][0]
                count = core["num_running_reqs"] + core["num_waiting_reqs"]
                if ok(count):
                    return
                await asyncio.sleep(0.05)
    except TimeoutError:
        pytest.fail(f"{what} (requests running or waiting: {count}, after {deadline_s:g}s)")

def _sampled_call(tok: ChatTokenizer, gateway: Served) -> dict[str, Any]:
    """The arguments of the <tool_call> the model sampled in the latest generation."""
    sampled = tok.decode(gateway.generations()[-1]["output_ids"])
    forced = re.match(r"<tool_call>\n(.*)\n</tool_call>", sampled)
    assert forced, f"the model sampled no <tool_call>: {sampled!r}"
    return json.loads(forced.group(1))["arguments"]


async def test_in_process_clients_reach_the_gateway_without_a_socket(sglang_url: str, chat_tokenizer: ChatTokenizer,
                                                                     tmp_path: Any) -> None:
    """``LocalGateway.http_client`` / ``anthropic_http_client`` (what agents get as ``ClientConfig.http_client``):
    the official clients through them complete bridged turns on the real server with the branch invariant; an SDK
    client closed by its agent leaves the shared client usable; a cancelled in-process request aborts its
    generation on SGLang and commits nothing, as a disconnect over HTTP does."""
    from gateway_support import Served

    from agentrl.engine.client import SGLangClient
    from agentrl.engine.recording import RecordingEngine
    from agentrl.gateway import GatewayConfig, LocalGateway

    records = tmp_path / "generate.jsonl"
    engine = RecordingEngine(SGLangClient(sglang_url), records)
    try:
        async with LocalGateway(engine, chat_tokenizer, GatewayConfig(model_name="tiny")) as gw, \
                httpx.AsyncClient(timeout=60) as http:
            served = Served(gw.url, gw.store, records)
            session = gw.store.create()
            messages: list[dict[str, Any]] = [{"role": "user", "content": "Hello?"}]
            for _ in range(2):  # the SDK client closes the shared client on exit: it must stay open
                async with openai.AsyncOpenAI(base_url=gw.base_url(session), api_key=session.api_key, max_retries=0,
                                              http_client=gw.http_client) as llm:
                    reply = await llm.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                             {"role": "user", "content": "And then?"}]
            ant = anthropic.AsyncAnthropic(base_url=gw.base_url(session).removesuffix("/v1"), api_key=session.api_key,
                                           max_retries=0, http_client=gw.anthropic_http_client)
            said = await ant.messages.create(model="tiny", max_tokens=8, messages=messages)  # type: ignore[arg-type]
            assert said.usage.output_tokens == len(served.generations()[-1]["output_ids"])
            branches = (await gw.store.close(session.id)).branches
            assert len(branches) == 1 and [t.bridged for t in branches[0].turns] == [False, True, True]
            check_branch(branches[0].to_json(), served.generations())

            session = gw.store.create()
            llm = openai.AsyncOpenAI(base_url=gw.base_url(session), api_key=session.api_key, max_retries=0,
                                     http_client=gw.http_client)
            request = asyncio.ensure_future(llm.chat.completions.create(model="tiny", messages=MESSAGES,
                                                                        max_tokens=8000))
            await _until(lambda n: n > 0, http, sglang_url, "the generation never started on SGLang")
            request.cancel()  # the agent's task goes away mid-generation
            with pytest.raises(asyncio.CancelledError):
                await request
            await _until(lambda n: n == 0, http, sglang_url, "SGLang still runs the cancelled in-process request",
                         deadline_s=10)
            async with asyncio.timeout(10):
                while session.inflight:
                    await asyncio.sleep(0.05)
            assert session.branches == []  # cancelled, nothing committed
    finally:
        await engine.inner.aclose()
        await engine.aclose()
