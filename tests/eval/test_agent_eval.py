"""Evaluating an agent environment (``@agentrl.agent``): on a served (token-level) engine the agent goes through a
gateway the run serves itself, one session per sample, token-level records; against an ``openai_url`` model it
calls that server directly (a fake OpenAI server here), ``token_level: false``. The real math checker scores."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openai
import pytest

from agentrl.engine.base import EngineFinish, GenerateResult, SamplingParams
from agentrl.engine.openai_chat import OpenAIChatClient
from agentrl.env.agent import ClientConfig, agent_factory
from agentrl.env.registry import Registry
from agentrl.errors import ConfigError
from agentrl.eval import EvalSpec, run_eval
from agentrl.tokenizer import ChatTokenizer, hermes_call_text
from agentrl.types import Task

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from openai_support import FakeOpenAI, Reply, Served  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
ITEMS = [{"prompt": "What is 2+3?", "answer": "5"}, {"prompt": "What is 4+4?", "answer": "8"}]


async def adder(task: Task, client: ClientConfig) -> str:
    """A plain openai loop: the add tool until the model answers in text."""
    async with openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0) as llm:
        messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
        for _ in range(4):
            msg = (await llm.chat.completions.create(model=client.model, messages=messages,  # type: ignore[arg-type]
                                                     tools=TOOLS)).choices[0].message  # type: ignore[arg-type]
            if not msg.tool_calls:
                return msg.content or ""
            (call,) = msg.tool_calls
            args = json.loads(call.function.arguments)
            messages += [{"role": "assistant", "content": msg.content or "", "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": "add", "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}]
    return ""


def _sums(prompt: str) -> tuple[int, int]:
    a, b = prompt.removeprefix("What is ").rstrip("?").split("+")
    return int(a), int(b)


class ToolEngine:
    """A token-level engine: the first request of a session (``sticky_key``) calls add on the user's numbers, the
    next answers the boxed sum (item 1's wrong on purpose)."""

    def __init__(self, tok: ChatTokenizer) -> None:
        self.tok = tok
        self.calls: list[SamplingParams] = []
        self.sessions: set[str | None] = set()

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *,
                       sticky_key: str | None = None) -> GenerateResult:
        self.calls.append(sampling)
        prompt = self.tok.decode(list(input_ids))
        a, b = _sums(re.findall(r"What is \d+\+\d+\?", prompt)[-1])
        if sticky_key not in self.sessions:
            self.sessions.add(sticky_key)
            reply = hermes_call_text("add", {"a": a, "b": b})
        else:
            reply = f"\\boxed{{{a + b if a != 4 else 9}}}"
        ids = self.tok.encode_text(reply) + [self.tok.eos_token_id]
        return GenerateResult(ids, [-0.5] * len(ids), [2] * len(ids), EngineFinish.STOP)

    async def update_weights(self, path: str, version: int) -> None: ...

    async def weight_version(self) -> int:
        return 2

    async def aclose(self) -> None: ...


def _registry(reward: str = "math") -> Registry:
    registry = Registry()
    registry.register_env("adder", agent_factory(adder, reward=reward, timeout_s=60))
    return registry


def spec(model: dict[str, Any], **kw: Any) -> EvalSpec:
    body: dict[str, Any] = {"environment": {"name": "adder"}, "dataset": {"items": ITEMS}, "model": model,
                            "sampling": {"max_new_tokens": 64, "temperature": 0.0}, "samples_per_item": 2,
                            "pass_k": [1, 2], "max_turns": 4, "sample_retries": 0}
    body.update(kw)
    return EvalSpec.model_validate(body)


async def test_an_agent_on_a_served_model_goes_through_a_gateway_and_is_token_level(resources,
                                                                                     chat_tokenizer) -> None:
    engine = ToolEngine(chat_tokenizer)
    result = await run_eval(spec({"url": "http://127.0.0.1:9"}), engine=engine, tokenizer=chat_tokenizer,
                            resources=resources, registry=_registry())
    m = result.metrics
    assert result.status == "succeeded" and m["token_level"] is True and m["num_errors"] == 0
    assert m["num_samples"] == 4 and m["accuracy"] == 0.5 and m["mean_turns"] == 2.0
    assert m["mean_tool_calls"] == 1.0
    assert len(engine.calls) == 8 and {s.temperature for s in engine.calls} == {0.0}  # the spec's sampling
    for r in sorted(result.records, key=lambda r: r.key):
        assert r.ok and r.token_level and r.trajectory is not None and r.model_tokens > 0
        assert r.correct is (r.item_index == 0) and r.reward == float(r.item_index == 0)
        traj = r.trajectory
        assert traj["trajectory_id"] == f"eval-{r.item_index}-{r.sample_index}"
        assert traj["turns"][0]["tool_calls"][0]["name"] == "add" and set(traj["weight_versions"]) >= {2}
        assert r.response.endswith(f"\\boxed{{{5 if r.item_index == 0 else 9}}}")


async def test_an_agent_against_an_openai_url_model_calls_it_directly(resources) -> None:
    def model(body: dict[str, Any], turn: int) -> str | Reply:
        a, b = _sums(next(m["content"] for m in body["messages"] if m["role"] == "user"))
        if turn == 0:
            return Reply(tool_calls=({"id": "call_1", "type": "function", "function": {
                "name": "add", "arguments": json.dumps({"a": a, "b": b})}},))
        return f"It is \\boxed{{{body['messages'][-1]['content']}}}."

    fake = FakeOpenAI(model)
    async with Served(fake), OpenAIChatClient(fake.url, model="fake-model") as engine:
        result = await run_eval(spec({"openai_url": fake.url, "openai_model": "fake-model"}), engine=engine,
                                tokenizer=None, resources=resources, registry=_registry())
        m = result.metrics
        assert result.status == "succeeded" and m["token_level"] is False and m["num_errors"] == 0
        assert m["num_samples"] == 4 and m["accuracy"] == 1.0
        for r in result.records:
            assert r.ok and r.correct and not r.token_level and r.trajectory is None and r.transcript is None
            assert r.response == f"It is \\boxed{{{5 if r.item_index == 0 else 8}}}."
        assert len(fake.requests) == 8 and all(q["model"] == "fake-model" and q["tools"] == TOOLS
                                               for q in fake.requests)

        with pytest.raises(ConfigError, match="no session to post to"):  # scored only by what it would post
            await run_eval(spec({"openai_url": fake.url}), engine=engine, tokenizer=None, resources=resources,
                           registry=_registry(reward="posted"))
