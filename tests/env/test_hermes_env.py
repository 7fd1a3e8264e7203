"""Hermes/Qwen tool calling: the parser, dispatch to @agentrl.tool functions (sync, async, concurrent), the
model's mistakes as error observations, budgets, and the token layout of a whole episode (tool results as the
chat template's tool-role delta, loss mask 0)."""

from __future__ import annotations

import asyncio
import json

import pytest
from env_support import ScriptedEngine

from agentrl.async_rollout import EpisodeRunner
from agentrl.engine.base import SamplingParams
from agentrl.env import EnvResources, ToolCallingEnv, parse_tool_calls, tool
from agentrl.errors import ConfigError, SandboxError
from agentrl.rewards import RewardInput, RewardResult
from agentrl.types import FinishReason, Task


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


@tool
async def lookup(key: str) -> dict:
    """Look a key up."""
    return {"key": key, "value": key.upper()}


@tool
def divide(a: float, b: float) -> float:
    """Divide a by b."""
    return a / b


@tool
async def forever() -> str:
    """Never returns."""
    await asyncio.sleep(3600)
    return "never"


@tool
async def sandbox_down() -> str:
    """A tool whose sandbox is unreachable."""
    raise SandboxError("sandbox at http://x unreachable")


class CalcEnv(ToolCallingEnv):
    name = "calc"
    tools = (add, lookup, divide, forever, sandbox_down)
    system_prompt = "You are a calculator."

    async def score(self, response: RewardInput) -> RewardResult:
        return RewardResult.scored(1.0 if "\\boxed{5}" in response.text else 0.0)


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# -- parser ---------------------------------------------------------------------------------------------------

def test_parses_every_call_of_a_turn():
    calls = parse_tool_calls(f"Let me add. {call('add', a=1, b=2)}\n{call('lookup', key='x')}<|im_end|>")
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 1, "b": 2}, None),
                                                                ("lookup", {"key": "x"}, None)]
    assert calls[0].raw == call("add", a=1, b=2)


def test_arguments_given_as_a_json_string_are_accepted():
    [c] = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>')
    assert c.error is None and c.arguments == {"a": 1, "b": 2}


@pytest.mark.parametrize("text, error", [
    ("<tool_call>{name: add}</tool_call>", "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "add", "arguments": {}}', "not closed"),
    ('{"name": "add"}</tool_call>', "without an opening"),
    ('<tool_call><tool_call>{"name": "add"}</tool_call>', "nested"),
])
def test_malformed_calls_say_what_is_wrong(text, error):
    [c] = parse_tool_calls(text)
    assert c.error is not None and error in c.error


@pytest.mark.parametrize("text", ["The answer is \\boxed{5}.", "", "<tool_ca"])
def test_no_call(text):
    assert parse_tool_calls(text) == []


# -- dispatch -------------------------------------------------------------------------------------------------

async def run_step(text: str, **options):
    env = CalcEnv(EnvResources(), **options)
    await env.reset(Task(id="t", prompt="2+3?"))
    return env, await env.step(text)


async def test_calls_run_and_answer_in_the_tool_role():
    _, r = await run_step(call("add", a=2, b=3) + call("lookup", key="k") + "<|im_end|>")
    assert not r.done and [t.status for t in r.tool_results] == ["ok", "ok"]
    assert list(r.observation.messages) == [
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "tool", "name": "lookup", "content": '{"key": "k", "value": "K"}'},
    ]


async def test_calls_of_one_turn_run_concurrently():
    both_started = asyncio.Event()
    started = []

    @tool
    async def meet(who: str) -> str:
        """Wait for the other call."""
        started.append(who)
        if len(started) == 2:
            both_started.set()
        await both_started.wait()  # deadlocks if the calls ran one after the other
        return who

    env = CalcEnv(EnvResources(), tools=[meet], tool_timeout_s=5)
    await env.reset(Task(id="t", prompt="?"))
    r = await env.step(call("meet", who="a") + call("meet", who="b"))
    assert [t.output for t in r.tool_results] == ["a", "b"]


@pytest.mark.parametrize("text, status, says", [
    (call("mul", a=1, b=2), "unknown_tool", "unknown tool 'mul'; available: add, divide"),
    (call("add", a=1), "malformed", "argument 'b' is missing"),
    (call("add", a="1", b=2), "malformed", "argument 'a': expected a valid integer, got \"1\""),
    (call("add", a=1, b=2, c=3), "malformed", "unknown argument 'c' (accepted: a, b)"),
    ("<tool_call>{oops}</tool_call>", "malformed", "not valid JSON"),
    (call("divide", a=1, b=0), "Error", "ZeroDivisionError"),
])
async def test_the_models_mistakes_become_error_observations(text, status, says):
    _, r = await run_step(text)
    assert not r.done and r.tool_results[0].status == status
    assert says in r.observation.messages[0]["content"]
    assert r.observation.messages[0]["content"].startswith("Error")
    if status != "Error":
        assert r.tool_calls[0].error  # counted as a malformed call by the format rewards


async def test_a_tool_that_hangs_times_out_as_an_observation():
    _, r = await asyncio.wait_for(run_step(call("forever"), tool_timeout_s=0.2), 30)
    assert r.tool_results[0].status == "TimeLimitExceeded" and "did not finish" in r.tool_results[0].output


async def test_infrastructure_failure_of_a_tool_is_an_error_not_an_observation():
    with pytest.raises(SandboxError):
        await run_step(call("sandbox_down"))


async def test_tool_call_budget_ends_the_episode():
    _, r = await run_step(call("add", a=1, b=1) + call("add", a=2, b=2) + call("add", a=3, b=3),
                          max_tool_calls=2)
    assert r.done and r.observation is None
    assert [t.status for t in r.tool_results] == ["ok", "ok", "budget"]


async def test_tools_by_registered_name(monkeypatch):
    from agentrl.env import default_registry

    monkeypatch.setitem(default_registry.tools, "add", add)  # as register_tool(add) does, undone after the test
    env = CalcEnv(EnvResources(), tools=["add"])
    assert "add" in [s["function"]["name"] for s in env.tool_schemas()]
    with pytest.raises(ConfigError, match="unknown tool 'nope'"):
        CalcEnv(EnvResources(), tools=["nope"])


# -- whole episodes -------------------------------------------------------------------------------------------

async def test_episode_token_layout(chat_tokenizer):
    engine = ScriptedEngine(chat_tokenizer, [(call("add", a=2, b=3), True), ("So \\boxed{5}.", True)])
    runner = EpisodeRunner(engine, chat_tokenizer, SamplingParams(max_new_tokens=64))
    async with CalcEnv(EnvResources()) as env:
        traj = await runner.run(env, Task(id="t", prompt="2+3?"), env_name="calc")
    prompt = engine.requests[0]
    assert '"name": "add"' in chat_tokenizer.decode(prompt) and "<tool_call>" in chat_tokenizer.decode(prompt)
    delta = chat_tokenizer.encode_messages_delta([{"role": "tool", "name": "add", "content": "5"}])
    assert chat_tokenizer.decode(delta) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    out1, out2 = engine.outputs
    assert engine.requests[1] == prompt + out1 + delta
    assert traj.token_ids.tolist() == prompt + out1 + delta + out2
    assert traj.loss_mask.tolist() == [0] * len(prompt) + [1] * len(out1) + [0] * len(delta) + [1] * len(out2)
    assert traj.reward == 1.0 and traj.finish_reason is FinishReason.STOP
    assert traj.turns[0].tool_results[0].output == "5" and traj.turns[0].observation_len == len(delta)


async def test_turn_ending_at_a_stop_string_gets_eos_before_the_tool_turn(chat_tokenizer):
    class StopAtCallEnd(CalcEnv):
        stop = ("</tool_call>",)

    engine = ScriptedEngine(chat_tokenizer, [(call("add", a=2, b=3), False), ("\\boxed{5}", True)])
    runner = EpisodeRunner(engine, chat_tokenizer, SamplingParams(max_new_tokens=64))
    traj = await runner.run(StopAtCallEnd(EnvResources()), Task(id="t", prompt="2+3?"))
    delta = chat_tokenizer.encode_messages_delta([{"role": "tool", "content": "5"}])
    obs = [chat_tokenizer.eos_token_id] + delta
    prompt, out1, out2 = engine.requests[0], *engine.outputs
    assert traj.token_ids.tolist() == prompt + out1 + obs + out2
    assert traj.loss_mask[len(prompt) + len(out1): len(prompt) + len(out1) + len(obs)].tolist() == [0] * len(obs)


async def test_episode_with_budget_exhausted_ends_with_max_turns(chat_tokenizer):
    engine = ScriptedEngine(chat_tokenizer, [(call("add", a=1, b=1), True)] * 3)
    runner = EpisodeRunner(engine, chat_tokenizer, SamplingParams(max_new_tokens=64))
    traj = await runner.run(CalcEnv(EnvResources(), max_tool_calls=2), Task(id="t", prompt="?"))
    assert traj.finish_reason is FinishReason.MAX_TURNS and len(traj.turns) == 3
