"""OpenAIChatClient against a fake OpenAI-compatible server (real HTTP on 127.0.0.1): stop strings on servers that
report them and on servers that do not, the model name, the API key header, retries, deadlines, tool calls.
The real server (SGLang's own OpenAI route) is in tests/eval/test_sglang_eval.py."""

from __future__ import annotations

import json

import pytest
from openai_support import Error, FakeOpenAI, Reply, Served, closed_port_url

from agentrl.engine.base import EngineFinish, EngineTimeout, EngineUnavailable, SamplingParams
from agentrl.engine.openai_chat import OpenAIChatClient, chat_base_url, cut_at_stop
from agentrl.errors import EngineError
from agentrl.retry import Retry

FAST = Retry(attempts=3, base_delay_s=0.01, max_delay_s=0.02)
MSGS = [{"role": "user", "content": "What is 6 * 7?"}]
CODE = SamplingParams(max_new_tokens=32, stop=("</code>",))


def test_urls_and_stop_cutting() -> None:
    assert chat_base_url("http://h:1/v1/") == chat_base_url("http://h:1/v1/chat/completions") == "http://h:1/v1"
    assert cut_at_stop("a<code>x</code>junk</code>", ["</code>"]) == ("a<code>x</code>", "</code>")
    assert cut_at_stop("abc", ["</code>"]) == ("abc", None)
    assert cut_at_stop("x END y STOP", ["STOP", "END"]) == ("x END", "END")  # the first one in the text


@pytest.mark.parametrize("style", ["sglang", "plain"])
async def test_the_turn_text_ends_at_the_stop_string_on_every_server(style: str) -> None:
    fake = FakeOpenAI(lambda body, turn: "<code>print(6*7)</code>\n<interpreter>made up</interpreter>", style=style)
    async with Served(fake), OpenAIChatClient(fake.url, model="m", retry=FAST) as client:
        first = await client.chat(MSGS, CODE)
        second = await client.chat(MSGS, CODE)
    assert first.text == second.text == "<code>print(6*7)</code>"
    assert first.finish is second.finish is EngineFinish.STOP and first.matched_stop == "</code>"
    assert "stop" not in fake.requests[0]  # not known yet whether this server reports the matched stop
    # a server that reports it gets the stop (saves tokens); one that does not is never sent it
    assert fake.requests[1].get("stop") == (["</code>"] if style == "sglang" else None)
    assert first.prompt_tokens == 5 and first.completion_tokens is not None


async def test_model_name_key_sampling_and_eos() -> None:
    fake = FakeOpenAI(lambda body, turn: Reply("The answer is \\boxed{42}.", usage=False), models=("served-1", "x"))
    sampling = SamplingParams(max_new_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop=("</code>",))
    async with Served(fake), OpenAIChatClient(fake.url + "/chat/completions", api_key="sk-test", retry=FAST) as c:
        out = await c.chat(MSGS, sampling)
    assert out.text == "The answer is \\boxed{42}." and out.matched_stop is None and out.finish is EngineFinish.STOP
    assert out.prompt_tokens is None and out.completion_tokens is None
    body = fake.requests[0]
    assert body["model"] == "served-1" and body["max_tokens"] == 7 and body["temperature"] == 0.5
    assert body["top_p"] == 0.9 and body["seed"] == 3 and body["n"] == 1 and "top_k" not in body
    assert fake.headers[0]["authorization"] == "Bearer sk-test"


async def test_length_and_structured_tool_calls() -> None:
    call = {"id": "call_7", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    script = {0: Reply("cut here", finish="length"), 1: Reply("", tool_calls=(call,))}
    fake = FakeOpenAI(lambda body, turn: script[len(fake.requests) - 1])
    tools = [{"name": "add", "description": "a + b", "parameters": {"type": "object"}}]
    async with Served(fake), OpenAIChatClient(fake.url, model="m", retry=FAST) as client:
        cut = await client.chat(MSGS, SamplingParams())
        calls = await client.chat(MSGS, SamplingParams(), tools=tools)
    assert cut.finish is EngineFinish.LENGTH
    assert [(c.id, c.name, json.loads(c.arguments)) for c in calls.tool_calls] == [("call_7", "add", {"a": 1, "b": 2})]
    assert fake.requests[1]["tools"] == [{"type": "function", "function": tools[0]}]


async def test_busy_answers_are_retried_then_reported() -> None:
    answers = iter([Error(503), Error(429), "fine"])
    fake = FakeOpenAI(lambda body, turn: next(answers))
    async with Served(fake), OpenAIChatClient(fake.url, model="m", retry=FAST) as client:
        assert (await client.chat(MSGS, SamplingParams())).text == "fine"
        assert len(fake.requests) == 3
        fake.script = lambda body, turn: Error(500)
        with pytest.raises(EngineError, match=r"HTTP 500.*after 3 attempts") as err:
            await client.chat(MSGS, SamplingParams())
        assert err.value.status == 500  # the last attempt's status, for callers that act on it
        fake.script = lambda body, turn: Error(401)
        with pytest.raises(EngineError, match="api_key_env") as err:
            await client.chat(MSGS, SamplingParams())
        assert err.value.status == 401
        fake.script = lambda body, turn: Error(400)
        n = len(fake.requests)
        with pytest.raises(EngineError, match="HTTP 400") as err:
            await client.chat(MSGS, SamplingParams())
        assert err.value.status == 400
        assert len(fake.requests) == n + 1  # a client error is not retried


async def test_deadline_and_unreachable_server() -> None:
    fake = FakeOpenAI(lambda body, turn: Reply("late", delay_s=5.0))
    async with Served(fake), OpenAIChatClient(fake.url, model="m", timeout_s=0.3, retry=FAST) as client:
        with pytest.raises(EngineTimeout, match="within 0.3s"):
            await client.chat(MSGS, SamplingParams())
    async with OpenAIChatClient(closed_port_url(), retry=FAST) as client:
        with pytest.raises(EngineUnavailable, match="cannot connect.*model.openai_url"):
            await client.chat(MSGS, SamplingParams())  # the model-name look-up is the first call to fail
