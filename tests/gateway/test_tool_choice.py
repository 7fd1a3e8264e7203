"""``tool_choice`` "required" / a named function: a grammar of the builtin <tool_call> format (checked with
xgrammar, SGLang's grammar backend), sent with the request through the official clients; what is refused (400).
On a real SGLang server: tests/gateway/test_gateway_sglang.py."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from gateway_support import ScriptedEngine
from test_app import MESSAGES, TOOLS, _serve

from agentrl.gateway import Gateway, GatewayConfig, SessionStore, create_app
from agentrl.gateway.tool_choice import tool_call_ebnf
from agentrl.tokenizer import hermes_call_text

MUL = {"type": "function", "function": {"name": "mul", "parameters": {"type": "object", "properties": {}}}}


def test_the_grammar_takes_builtin_format_calls_only() -> None:
    xgrammar = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    free = {"type": "function", "function": {"name": "note"}}  # no schema: any argument names
    required = xgrammar.Grammar.from_ebnf(tool_call_ebnf([*TOOLS, MUL, free], many=True))
    named = xgrammar.Grammar.from_ebnf(tool_call_ebnf(TOOLS, many=False))
    add = hermes_call_text("add", {"a": -2, "b": 3.5e2})
    note = hermes_call_text("note", {"s": 'say "hi"\n', "l": [1, {}, None, True], "u": "é"})
    mul = hermes_call_text("mul", {})
    for text in (add, f"{add}\n{mul}", note, f"{note}\n{add}\n{add}", hermes_call_text("add", {"b": "x"})):
        assert accepts(required, text), text
    for text in ("It is 5.", f"Sure. {add}", hermes_call_text("sub", {}), add + mul, add + "\n",
                 add.replace(", ", ","), hermes_call_text("add", {"c": 1}), hermes_call_text("mul", {"a": 1})):
        assert not accepts(required, text), text
    assert accepts(named, add) and not accepts(named, mul) and not accepts(named, f"{add}\n{add}")


async def test_required_and_a_named_function_are_sent_as_a_grammar(smollm2_tokenizer) -> None:
    call = hermes_call_text("add", {"a": 2, "b": 3})
    http, store, engine = _serve(smollm2_tokenizer, [call] * 4)
    created = (await http.post("/sessions")).json()
    client = openai.AsyncOpenAI(base_url=created["base_url"], api_key=created["api_key"], http_client=http)
    tools = [*TOOLS, MUL]
    done = await client.chat.completions.create(model="t", messages=MESSAGES, tools=tools, tool_choice="required")
    assert done.choices[0].finish_reason == "tool_calls" and done.choices[0].message.tool_calls[0].function.name == "add"
    assert engine.samplings[-1].ebnf == tool_call_ebnf(tools, many=True)
    await client.chat.completions.create(model="t", messages=MESSAGES, tools=tools,
                                         tool_choice={"type": "function", "function": {"name": "add"}})
    assert engine.samplings[-1].ebnf == tool_call_ebnf(TOOLS, many=False)
    await client.chat.completions.create(model="t", messages=MESSAGES, tools=tools, tool_choice="required",
                                         extra_body={"regex": "<tool_call>.*"})  # the request's own constraint
    assert engine.samplings[-1].ebnf is None and engine.samplings[-1].regex == "<tool_call>.*"
    ant = anthropic.AsyncAnthropic(base_url=created["anthropic_base_url"], api_key=created["api_key"],
                                   http_client=http.anthropic)
    msg = await ant.messages.create(model="t", max_tokens=64, messages=[{"role": "user", "content": "2+3?"}],
                                    tools=[{"name": "add", "input_schema": TOOLS[0]["function"]["parameters"]}],
                                    tool_choice={"type": "any"})
    assert msg.stop_reason == "tool_use" and engine.samplings[-1].ebnf == tool_call_ebnf(TOOLS, many=True)


async def test_what_cannot_be_honoured_is_refused_with_a_400(smollm2_tokenizer) -> None:
    http, store, engine = _serve(smollm2_tokenizer, [])
    created = (await http.post("/sessions")).json()
    client = openai.AsyncOpenAI(base_url=created["base_url"], api_key=created["api_key"], http_client=http,
                                max_retries=0)
    for kwargs, says in [(dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "sub"}}),
                          "not among the tools"),
                         (dict(tool_choice="required"), "needs tools"),
                         (dict(tools=TOOLS, tool_choice="always"), "not among the tools"),
                         (dict(tools=TOOLS, tool_choice={"type": "allowed_tools"}), "tool_choice must be")]:
        with pytest.raises(openai.BadRequestError, match=says):
            await client.chat.completions.create(model="t", messages=MESSAGES, **kwargs)  # type: ignore[arg-type]
    assert engine.prompts == []

    tok = smollm2_tokenizer  # another tool parser: the model family's format, which the gateway does not force
    app = create_app(Gateway(ScriptedEngine(tok, ["Five."]), tok, GatewayConfig(tool_parser="qwen25")), SessionStore())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as other:
        created = (await other.post("/sessions")).json()
        client = openai.AsyncOpenAI(base_url=created["base_url"], api_key="k", http_client=other, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="only with the builtin <tool_call> parser.*qwen25"):
            await client.chat.completions.create(model="t", messages=MESSAGES, tools=TOOLS, tool_choice="required")
        auto = await other.post(f"{created['base_url']}/chat/completions",
                                json={"model": "t", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"})
        assert auto.json()["choices"][0]["message"]["content"] == "Five."  # "none" (and "auto") are fine
