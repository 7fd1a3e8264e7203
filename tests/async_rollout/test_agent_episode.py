"""Agent episodes: a user's agent function (the official ``openai`` client) against the in-process gateway (a real
uvicorn server) on a scripted engine; its branches as trajectories; budgets; what the agent's failures become;
the scheduler and the trainer's read rule with groups larger than ``n_samples``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from agentrl.async_rollout.agent_episode import AgentRunner, branch_trajectories, owned_masks
from agentrl.async_rollout.config import EpisodeBudget
from agentrl.engine.base import EngineFinish, GenerateResult, SamplingParams
from agentrl.env.agent import AgentEnv, AgentError, ClientConfig, agent_factory
from agentrl.env.registry import EnvResources, Registry
from agentrl.errors import EngineError, InfrastructureError
from agentrl.gateway import GatewayConfig, LocalGateway
from agentrl.gateway.session import Branch, TurnRecord
from agentrl.rewards import RewardInput, RewardResult
from agentrl.tokenizer import ChatTokenizer, hermes_call_text
from agentrl.types import FinishReason, Task

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
TASK = Task(id="t1", prompt="What is 2+3?", answer="5")


class Scripted:
    """Answers each request with the next text (+ EOS); version 7 on every token; records prompts and budgets.
    An ``Exception`` in the script is raised instead (an engine failure)."""

    def __init__(self, tok: ChatTokenizer, replies: Sequence[str | Exception], *, delay_s: float = 0.0):
        self.tok, self.replies, self.delay_s = tok, list(replies), delay_s
        self.calls: list[tuple[list[int], SamplingParams]] = []

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *,
                       sticky_key: str | None = None) -> GenerateResult:
        self.calls.append((list(input_ids), sampling))
        reply = self.replies.pop(0) if self.replies else "done"
        await asyncio.sleep(self.delay_s)
        if isinstance(reply, Exception):
            raise reply
        ids = (self.tok.encode_text(reply) + [self.tok.eos_token_id])[: sampling.max_new_tokens]
        finish = EngineFinish.STOP if len(ids) < sampling.max_new_tokens or ids[-1] == self.tok.eos_token_id \
            else EngineFinish.LENGTH
        return GenerateResult(ids, [-0.25] * len(ids), [7] * len(ids), finish, matched_stop=self.tok.eos_token_id)


async def exact_reward(task: Task, response: RewardInput) -> RewardResult:
    return RewardResult.scored(1.0 if response.text.strip() == f"\\boxed{{{task.answer}}}" else 0.0)


async def tool_agent(task: Task, client: ClientConfig) -> str:
    """A plain openai loop: call tools until the model answers in text."""
    async with openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0) as llm:
        messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
        for _ in range(6):
            msg = (await llm.chat.completions.create(model=client.model, messages=messages,  # type: ignore[arg-type]
                                                     tools=TOOLS)).choices[0].message  # type: ignore[arg-type]
            if not msg.tool_calls:
                return msg.content or ""
            messages.append({"role": "assistant", "content": msg.content or "", "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                              "arguments": c.function.arguments}}
                for c in msg.tool_calls]})
            for c in msg.tool_calls:
                args = json.loads(c.function.arguments)
                messages.append({"role": "tool", "tool_call_id": c.id, "content": str(args["a"] + args["b"])})
    return ""


@pytest.fixture
async def served(chat_tokenizer: ChatTokenizer) -> AsyncIterator[Any]:
    engines: list[LocalGateway] = []

    async def make(replies: Sequence[str | Exception], budget: EpisodeBudget = EpisodeBudget(),
                   **kw: Any) -> tuple[AgentRunner, Scripted]:
        engine = Scripted(chat_tokenizer, replies, **kw)
        gw = LocalGateway(engine, chat_tokenizer, GatewayConfig(model_name="tiny"))
        await gw.start()
        engines.append(gw)
        return AgentRunner(gw, chat_tokenizer, SamplingParams(max_new_tokens=64, temperature=0.9), budget), engine

    yield make
    for gw in engines:
        await gw.aclose()


def _env(run: Any, reward: Any = exact_reward, **kw: Any) -> AgentEnv:
    return agent_factory(run, reward=reward, **kw)(EnvResources())


async def test_a_tool_calling_agent_is_one_exact_trajectory_with_its_reward(served, chat_tokenizer) -> None:
    runner, engine = await served([hermes_call_text("add", {"a": 2, "b": 3}), "\\boxed{5}"])
    [traj] = await runner.episode(_env(tool_agent), TASK, env_name="calc", group_id="g")
    assert traj.reward == 1.0 and traj.finish_reason is FinishReason.STOP and traj.group_id == "g"
    assert traj.env == "calc" and traj.metadata["branches"] == 1
    # the branch invariant: each prompt is a prefix, followed by exactly the ids the engine returned (mask 1)
    ids, mask = traj.token_ids.tolist(), traj.loss_mask.tolist()
    for (prompt, _), turn in zip(engine.calls, traj.turns):
        assert ids[: len(prompt)] == prompt and turn.token_start == len(prompt)
    assert sum(mask) == sum(t.token_end - t.token_start for t in traj.turns)
    assert set(traj.weight_versions[traj.loss_mask.astype(bool)].tolist()) == {7}
    assert np.allclose(traj.behavior_logprobs[traj.loss_mask.astype(bool)], -0.25)
    assert traj.turns[0].tool_calls[0].name == "add" and traj.turns[0].tool_calls[0].arguments == {"a": 2, "b": 3}
    assert traj.turns[0].observation_len > 0 and traj.turns[1].text == "\\boxed{5}"
    # the run's sampling is imposed on the agent's requests, whatever it asked
    assert {s.temperature for _, s in engine.calls} == {0.9}


async def test_budgets_max_turns_and_the_context(served) -> None:
    call = hermes_call_text("add", {"a": 1, "b": 1})
    runner, engine = await served([call] * 5, EpisodeBudget(max_turns=2))
    [traj] = await runner.episode(_env(tool_agent), TASK)
    assert len(engine.calls) == 2 and traj.finish_reason is FinishReason.MAX_TURNS and traj.reward == 0.0

    runner, engine = await served([call] * 5, EpisodeBudget(max_context_tokens=200))
    [traj] = await runner.episode(_env(tool_agent), TASK)
    for prompt, sampling in engine.calls:  # max_tokens clamped to what remains of the context
        assert sampling.max_new_tokens <= 200 - len(prompt)
    assert traj.num_tokens <= 200 and traj.finish_reason is FinishReason.LENGTH


async def test_a_prompt_that_fills_the_context_gets_an_empty_length_answer(served) -> None:
    answers: list[Any] = []
    sessions: list[Any] = []

    async def two_turns(task: Task, client: ClientConfig) -> str:
        sessions.append(runner.gateway.store.get(client.session_id))
        async with openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0) as llm:
            messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
            for _ in range(2):
                answers.append(answer := await llm.chat.completions.create(
                    model=client.model, messages=messages, tools=TOOLS))  # type: ignore[arg-type]
                msg = answer.choices[0].message
                if not msg.tool_calls:
                    return msg.content or ""
                (c,) = msg.tool_calls
                messages += [{"role": "assistant", "content": "", "tool_calls": [
                    {"id": c.id, "type": "function", "function": {"name": "add", "arguments": c.function.arguments}}]},
                    {"role": "tool", "tool_call_id": c.id, "content": "5"}]
        return ""

    call = hermes_call_text("add", {"a": 2, "b": 3})
    runner, engine = await served([call, "\\boxed{5}"])
    await runner.episode(_env(two_turns), TASK)
    second_prompt = len(engine.calls[1][0])  # the context the second request's prompt fills exactly
    answers.clear()
    runner, engine = await served([call, "never sampled"], EpisodeBudget(max_context_tokens=second_prompt))
    [traj] = await runner.episode(_env(two_turns), TASK)
    assert len(engine.calls) == 1  # the second request generated nothing
    full = answers[-1]
    assert full.choices[0].message.content == "" and not full.choices[0].message.tool_calls
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 0
    assert full.usage.prompt_tokens == second_prompt
    assert sessions[-1].exhausted == "length" and sessions[-1].generations == 1
    assert traj.finish_reason is FinishReason.LENGTH and traj.num_tokens == len(engine.calls[0][0]) + len(
        runner.tok.encode_text(call)) + 1  # the branch ends with the first turn: the empty answer adds no tokens


async def test_the_agent_posted_reward_is_added(served) -> None:
    async def posting(task: Task, client: ClientConfig) -> str:
        answer = await tool_agent(task, client)
        async with httpx.AsyncClient(timeout=10) as http:
            (await http.post(client.reward_url, json={"reward": 0.5})).raise_for_status()
        return answer

    runner, _ = await served(["\\boxed{5}"])
    [traj] = await runner.episode(_env(posting), TASK)
    assert traj.reward == 1.5 and traj.reward_breakdown == {"correct": 1.0, "posted": 0.5}
    runner, _ = await served(["\\boxed{5}"])
    [traj] = await runner.episode(_env(posting, reward="posted"), TASK)
    assert traj.reward == 0.5


async def test_an_agent_that_rewrites_its_history_forks_and_each_token_is_trained_once(served) -> None:
    async def rewriter(task: Task, client: ClientConfig) -> str:
        async with openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0) as llm:
            first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": task.prompt}]
            a = (await llm.chat.completions.create(model="m", messages=first)).choices[0].message.content  # type: ignore[arg-type]
            follow = [*first, {"role": "assistant", "content": a}, {"role": "user", "content": "Sure?"}]
            await llm.chat.completions.create(model="m", messages=follow)  # type: ignore[arg-type]
            compacted = [{"role": "system", "content": "Summary: the user asked 2+3."},
                         {"role": "user", "content": "Answer."}]
            return (await llm.chat.completions.create(model="m", messages=compacted)).choices[0].message.content or ""  # type: ignore[arg-type]

    runner, engine = await served(["Five.", "Yes, five.", "\\boxed{5}"])
    trajs = await runner.episode(_env(rewriter), TASK, group_id="g")
    assert len(trajs) == 2 and all(t.reward == 1.0 for t in trajs)
    assert [t.metadata["branch"] for t in trajs] == [0, 1] and trajs[1].metadata["parent"] == 0
    # every generated token is trained in exactly one trajectory
    assert sum(t.num_model_tokens for t in trajs) == sum(
        len(runner.tok.encode_text(r)) + 1 for r in ["Five.", "Yes, five.", "\\boxed{5}"])


def test_owned_masks_train_a_shared_token_once_also_past_a_dropped_branch() -> None:
    root = Branch(0, token_ids=[1, 2, 3, 4, 5, 6], loss_mask=[0, 0, 1, 1, 0, 1])
    child = Branch(1, token_ids=[1, 2, 3, 4, 9, 9], loss_mask=[0, 0, 1, 1, 1, 1], parent=0, fork_at=4)
    grandchild = Branch(2, token_ids=[1, 2, 3, 8, 8], loss_mask=[0, 0, 1, 1, 1], parent=1, fork_at=3)
    # the child sampled [4:6) itself; a sibling that sampled tokens the root only had as prompt keeps them
    sibling = Branch(3, token_ids=[1, 2, 3, 4, 5], loss_mask=[0, 0, 1, 1, 1], parent=0, fork_at=5)
    masks = owned_masks([root, child, grandchild, sibling], {0, 1, 2, 3})
    assert masks == {0: [0, 0, 1, 1, 0, 1], 1: [0, 0, 0, 0, 1, 1], 2: [0, 0, 0, 1, 1], 3: [0, 0, 0, 0, 1]}
    # the child dropped: the grandchild shares min(fork_at) = 3 tokens with the root
    masks = owned_masks([root, child, grandchild, sibling], {0, 2})
    assert masks == {0: [0, 0, 1, 1, 0, 1], 2: [0, 0, 0, 1, 1]}


def _branch(index: int, ids: list[int], mask: list[int], turns: list[tuple[int, int, str]], *,
            parent: int | None = None, fork_at: int = 0) -> Branch:
    return Branch(index, token_ids=ids, loss_mask=mask, logprobs=[-0.5 * m for m in mask],
                  weight_versions=[2 if m else -1 for m in mask], parent=parent, fork_at=fork_at,
                  turns=[TurnRecord(a, b, reason) for a, b, reason in turns])


def test_past_max_branches_the_first_and_the_last_are_kept_and_each_token_trained_once(chat_tokenizer) -> None:
    branches = [
        _branch(0, [1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 0, 1], [(2, 4, "stop"), (5, 6, "stop")]),
        _branch(1, [1, 2, 3, 4, 9, 9], [0, 0, 1, 1, 1, 1], [(2, 4, "stop"), (4, 6, "stop")], parent=0, fork_at=4),
        _branch(2, [1, 2, 3, 8, 8, 7], [0, 0, 1, 1, 1, 1], [(2, 5, "stop"), (5, 6, "stop")], parent=1, fork_at=3),
        _branch(3, [1, 2, 6, 6], [0, 0, 1, 1], [(2, 4, "length")], parent=0, fork_at=2),
    ]

    def kept(keep: int, last: int) -> list[Any]:
        return branch_trajectories(branches, chat_tokenizer, keep=keep, last=last, trajectory_id="t", task=TASK,
                                   group_id="g", env="calc", reward=1.0, breakdown={"calc": 1.0},
                                   finish=FinishReason.MAX_TURNS, metadata={})

    first, last = kept(2, 2)
    assert [t.metadata["branch"] for t in (first, last)] == [0, 2] and first.metadata["branches_dropped"] == 2
    assert [t.trajectory_id for t in (first, last)] == ["t-0", "t-2"]
    assert first.loss_mask.tolist() == [0, 0, 1, 1, 0, 1]
    assert last.loss_mask.tolist() == [0, 0, 0, 1, 1, 1]  # token 2 is the root's; 3.. were sampled past the fork
    assert last.finish_reason is FinishReason.MAX_TURNS and first.finish_reason is FinishReason.STOP
    # only the mask changes where the root owns a token: the branch keeps its logprobs
    assert last.behavior_logprobs.tolist() == [0, 0, -0.5, -0.5, -0.5, -0.5]

    trajs = kept(3, 3)  # the first keep - 1 = 2 and the last
    assert [t.metadata["branch"] for t in trajs] == [0, 1, 3]
    assert [t.loss_mask.tolist() for t in trajs] == [[0, 0, 1, 1, 0, 1], [0, 0, 0, 0, 1, 1], [0, 0, 1, 1]]
    assert trajs[-1].finish_reason is FinishReason.MAX_TURNS
    # every (position, token) of a shared prefix is trained in one kept trajectory only
    for a in range(len(trajs)):
        for b in range(a + 1, len(trajs)):
            x, y = trajs[a], trajs[b]
            n = next((i for i, (p, q) in enumerate(zip(x.token_ids, y.token_ids)) if p != q),
                     min(x.num_tokens, y.num_tokens))
            assert not any(x.loss_mask[:n] & y.loss_mask[:n]), (x.metadata["branch"], y.metadata["branch"])


async def test_what_the_agent_failing_becomes(served) -> None:
    async def broken(task: Task, client: ClientConfig) -> str:
        await tool_agent(task, client)
        raise KeyError("the model's output broke the agent")

    runner, _ = await served(["no tool"])
    [traj] = await runner.episode(_env(broken), TASK)  # the model's doing: scored, the error recorded
    assert traj.reward == 0.0 and "KeyError" in traj.metadata["agent_error"]

    async def silent(task: Task, client: ClientConfig) -> str:
        return "\\boxed{5}"

    runner, _ = await served([])
    with pytest.raises(AgentError, match="made no chat request"):
        await runner.episode(_env(silent), TASK)

    runner, _ = await served(["slow"], delay_s=5)
    with pytest.raises(AgentError, match="did not return within 1s"):
        await runner.episode(_env(tool_agent, timeout_s=1), TASK)
    assert len(runner.gateway.store) == 0  # the session was closed, its generation cancelled

    runner, _ = await served([EngineError("sglang down")])
    with pytest.raises(EngineError, match="sglang down"):
        await runner.episode(_env(tool_agent), TASK)
    assert issubclass(AgentError, InfrastructureError)


async def test_cancelling_an_episode_closes_its_session(served) -> None:
    runner, engine = await served(["slow"], delay_s=30)
    episode = asyncio.ensure_future(runner.episode(_env(tool_agent), TASK))
    while not engine.calls:
        await asyncio.sleep(0.02)
    episode.cancel()
    with pytest.raises(asyncio.CancelledError):
        await episode
    assert len(runner.gateway.store) == 0


def test_agents_register_as_their_own_kind() -> None:
    registry = Registry()
    registry.register_env("calc", agent_factory(tool_agent, reward="math"))
    assert registry.get_env("calc").kind == "agent"
    registry.register_env("calc", agent_factory(tool_agent, reward="math"))  # the same definition again: fine
    with pytest.raises(Exception, match="math checker pool"):
        registry.make_env("calc", EnvResources())
    with pytest.raises(Exception, match="reward must be one of"):
        agent_factory(tool_agent, reward="maths")
    with pytest.raises(Exception, match="rejected its options"):
        registry.make_env("calc", EnvResources(verifier=object()), tools=3)
