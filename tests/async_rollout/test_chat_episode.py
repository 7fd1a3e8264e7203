"""ChatEpisodeRunner with a scripted chat engine: how turns and observations become chat messages, budgets,
rewards. Over HTTP (a fake server and SGLang's own OpenAI route) with the real environments: tests/eval."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from agentrl.async_rollout.chat_episode import ChatEpisodeRunner, tool_call_text
from agentrl.async_rollout.config import EpisodeBudget
from agentrl.engine.base import ChatEngine, ChatResult, ChatToolCall, EngineFinish, SamplingParams
from agentrl.env.base import Environment, Observation, StepResult, prompt_messages
from agentrl.errors import EngineError, RewardError
from agentrl.rewards import RewardInput, RewardResult
from agentrl.types import FinishReason, Task, ToolCall, ToolResult

TASK = Task(id="t", prompt="What is 6 * 7?", answer="42")


@dataclass
class ScriptedChat:
    """Answers turn k (assistant messages so far) with ``script[k]``; remembers every request."""

    script: list[ChatResult | Exception]
    requests: list[tuple[list[dict[str, Any]], SamplingParams, list[Mapping[str, Any]]]] = field(default_factory=list)

    async def chat(self, messages: Sequence[Mapping[str, Any]], sampling: SamplingParams, *,
                   tools: Sequence[Mapping[str, Any]] = ()) -> ChatResult:
        self.requests.append(([dict(m) for m in messages], sampling, list(tools)))
        out = self.script[sum(1 for m in messages if m["role"] == "assistant")]
        if isinstance(out, Exception):
            raise out
        return out

    async def aclose(self) -> None: ...


class CodeEnv(Environment):
    """ReTool's shape: stops at ``</code>``, answers with raw interpreter text; correct iff the text holds 42."""

    name = "code"
    stop = ("</code>",)

    def __init__(self, score_ok: bool = True) -> None:
        self.steps: list[str] = []
        self.score_ok = score_ok

    async def reset(self, task: Task) -> list[dict[str, Any]]:
        return prompt_messages(task, "Use <code>.")

    async def step(self, text: str) -> StepResult:
        self.steps.append(text)
        if "<code>" not in text:
            return StepResult(None, True)
        call = ToolCall("python", {"code": "print(6*7)"}, raw=text)
        return StepResult(Observation(text="\n<interpreter>\n42\n</interpreter>\n"), False, (call,),
                          (ToolResult("python", "Finished", "42"),))

    async def score(self, response: RewardInput) -> RewardResult:
        if not self.score_ok:
            return RewardResult.infra_error("checker down")
        return RewardResult(1.0 if "42" in response.text else 0.0, details={"breakdown": {"correct": 1.0}})


class ToolEnv(CodeEnv):
    """Tool messages as observations (the Hermes environments' shape)."""

    name = "tools"
    stop = ()

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [{"name": "add", "description": "a + b", "parameters": {"type": "object"}}]

    async def step(self, text: str) -> StepResult:
        self.steps.append(text)
        if "<tool_call>" not in text:
            return StepResult(None, True)
        return StepResult(Observation(messages=({"role": "tool", "name": "add", "content": "42"},)), False,
                          (ToolCall("add", {"a": 40, "b": 2}),), (ToolResult("add", "ok", "42"),))


def ok(text: str, finish: EngineFinish = EngineFinish.STOP, **kw: Any) -> ChatResult:
    return ChatResult(text=text, finish=finish, **kw)


async def test_raw_text_observations_become_user_messages_and_the_reward_is_the_envs() -> None:
    engine = ScriptedChat([ok("<code>print(6*7)</code>", matched_stop="</code>", prompt_tokens=20, completion_tokens=6),
                           ok("So \\boxed{42}.", prompt_tokens=40, completion_tokens=5)])
    assert isinstance(engine, ChatEngine)
    env = CodeEnv()
    runner = ChatEpisodeRunner(engine, SamplingParams(max_new_tokens=64, stop=("END",)), EpisodeBudget(max_turns=4))
    ep = await runner.run(env, TASK, env_name="code", trajectory_id="x")
    assert ep.reward == 1.0 and ep.reward_breakdown == {"correct": 1.0} and ep.finish_reason is FinishReason.STOP
    assert env.steps == ["<code>print(6*7)</code>", "So \\boxed{42}."]
    assert [t.text for t in ep.turns] == env.steps and len(ep.turns[0].tool_calls) == 1
    assert all(t.token_start == t.token_end == 0 for t in ep.turns)
    assert [m["role"] for m in ep.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert ep.messages[3]["content"] == "<interpreter>\n42\n</interpreter>"
    second_request = engine.requests[1][0]
    assert second_request == list(ep.messages[:4])
    assert engine.requests[0][1].stop == ("END", "</code>") and engine.requests[0][2] == []
    assert (ep.prompt_tokens, ep.completion_tokens, ep.context_tokens) == (20, 11, 45)


async def test_structured_tool_calls_are_paired_with_their_results() -> None:
    call = ChatToolCall(id="call_1", name="add", arguments='{"a": 40, "b": 2}')
    engine = ScriptedChat([ok("Let me add.", tool_calls=(call,)), ok("\\boxed{42}")])
    env = ToolEnv()
    ep = await ChatEpisodeRunner(engine, SamplingParams()).run(env, TASK)
    assert env.steps[0] == "Let me add.\n" + tool_call_text("add", '{"a": 40, "b": 2}')
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 40, "b": 2}}\n</tool_call>' in env.steps[0]
    assistant, tool = ep.messages[2], ep.messages[3]
    assert assistant["tool_calls"] == [{"id": "call_1", "type": "function",
                                        "function": {"name": "add", "arguments": '{"a": 40, "b": 2}'}}]
    assert tool == {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    assert engine.requests[0][2] == env.tool_schemas() and ep.reward == 1.0


async def test_budgets_end_the_episode() -> None:
    code = ok("<code>x</code>", matched_stop="</code>", prompt_tokens=10, completion_tokens=4)
    ep = await ChatEpisodeRunner(ScriptedChat([code] * 5), SamplingParams(), EpisodeBudget(max_turns=2)).run(
        CodeEnv(), TASK)
    assert ep.finish_reason is FinishReason.MAX_TURNS and len(ep.turns) == 2
    cut = await ChatEpisodeRunner(ScriptedChat([ok("<code>pri", EngineFinish.LENGTH)]), SamplingParams()).run(
        CodeEnv(), TASK)
    assert cut.finish_reason is FinishReason.LENGTH and cut.turns[0].text == "<code>pri"
    # usage counts bound max_new_tokens and end an episode whose context is full
    engine = ScriptedChat([ok("<code>x</code>", matched_stop="</code>", prompt_tokens=50, completion_tokens=40),
                           ok("<code>y</code>", matched_stop="</code>", prompt_tokens=95, completion_tokens=5)])
    full = await ChatEpisodeRunner(engine, SamplingParams(max_new_tokens=64),
                                   EpisodeBudget(max_turns=8, max_response_tokens=100, max_context_tokens=100)).run(
        CodeEnv(), TASK)
    assert full.finish_reason is FinishReason.LENGTH and len(full.turns) == 3 and full.turns[2].text == ""
    assert [r[1].max_new_tokens for r in engine.requests] == [64, 10]  # min(100 - 90 context, 100 - 40 response)


async def test_infrastructure_failures_raise() -> None:
    with pytest.raises(EngineError):
        await ChatEpisodeRunner(ScriptedChat([EngineError("down")]), SamplingParams()).run(CodeEnv(), TASK)
    with pytest.raises(RewardError, match="checker down"):
        await ChatEpisodeRunner(ScriptedChat([ok("\\boxed{1}")]), SamplingParams()).run(CodeEnv(score_ok=False), TASK)
