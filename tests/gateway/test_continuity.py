"""Token continuity on real chat templates (SmolLM2's, a Qwen2.5 one, a thinking-stripping one), with a scripted
engine: bridged prompts equal full renders where the template appends; everything else forks at the first
differing token; the branch invariant; retries replayed; a cancelled request aborts its generation."""

from __future__ import annotations

import asyncio
import json

import pytest
from gateway_support import ScriptedEngine

from agentrl.engine.base import EngineFinish, GenerateResult, SamplingParams
from agentrl.errors import EngineError
from agentrl.gateway import ChatCall, Gateway, GatewayConfig, SessionStore
from agentrl.gateway.core import assistant_message
from agentrl.gateway.session import common_prefix
from agentrl.tokenizer import ChatTokenizer, hermes_call_text

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
SYSTEM = {"role": "system", "content": "You are a careful calculator."}
USER = {"role": "user", "content": "What is 2+3, then times 4?"}
CALL = hermes_call_text("add", {"a": 2, "b": 3})


def _gateway(tok: ChatTokenizer, replies: list, **kw) -> tuple[Gateway, ScriptedEngine, SessionStore]:
    engine = ScriptedEngine(tok, replies, **kw)
    return Gateway(engine, tok, GatewayConfig()), engine, SessionStore()


def _tool_message(completion, content: str) -> dict:
    return {"role": "tool", "tool_call_id": completion.tool_calls[0].id, "content": content}


@pytest.mark.parametrize("name", ["smollm2_tokenizer", "qwen25_tokenizer"])
def test_the_delta_after_a_real_history_equals_the_full_render(name: str, request: pytest.FixtureRequest) -> None:
    tok: ChatTokenizer = request.getfixturevalue(name)
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
    history = [SYSTEM, USER, call]
    for tail in ([{"role": "tool", "content": "5"}],
                 [{"role": "tool", "content": "5"}, {"role": "tool", "content": "6"}],
                 [{"role": "user", "content": "and now?"}]):
        sampled = tok.encode_text(CALL) + [tok.eos_token_id]  # what a model following the format samples
        bridged = tok.encode_prompt(history[:2], TOOLS) + sampled + tok.encode_continuation(history, tail, TOOLS)
        assert bridged == tok.encode_prompt([*history, *tail], TOOLS)


async def test_a_linear_tool_calling_agent_makes_one_branch_equal_to_the_full_render(qwen25_tokenizer) -> None:
    tok = qwen25_tokenizer
    gw, engine, store = _gateway(tok, [CALL, hermes_call_text("add", {"a": 5, "b": 5}), "It is 20."])
    session = store.create()
    messages = [SYSTEM, USER]
    for result in ("5", "10"):
        done = await gw.complete(session, ChatCall(messages=messages, tools=TOOLS))
        assert done.finish_reason == "tool_calls" and done.tool_calls[0].name == "add"
        # the client sends back ids and arguments as JSON strings; the gateway reads them back into dicts
        echoed = assistant_message(done)
        echoed["tool_calls"][0]["function"]["arguments"] = json.loads(json.dumps(done.tool_calls[0].arguments))
        messages = [*messages, echoed, _tool_message(done, result)]
    final = await gw.complete(session, ChatCall(messages=messages, tools=TOOLS))
    assert final.content == "It is 20." and final.finish_reason == "stop" and not final.tool_calls
    assert len(session.branches) == 1
    branch = session.branches[0]
    assert [t.bridged for t in branch.turns] == [False, True, True]
    # append-only template and canonical samples: the bridged prompt is exactly the full render
    assert engine.prompts[-1] == tok.encode_prompt(messages, TOOLS)
    # invariant: the branch is the last prompt + its sampled ids; mask 1 exactly on sampled ids with their logprobs
    assert branch.token_ids[: len(engine.prompts[-1])] == engine.prompts[-1]
    for turn, prompt in zip(branch.turns, engine.prompts):
        assert branch.token_ids[: turn.start] == prompt
        assert branch.loss_mask[turn.start: turn.end] == [1] * (turn.end - turn.start)
        assert all(v == 3 for v in branch.weight_versions[turn.start: turn.end])
    assert sum(branch.loss_mask) == sum(t.end - t.start for t in branch.turns)
    lp = [x for x, m in zip(branch.logprobs, branch.loss_mask) if m]
    assert lp == pytest.approx([-0.01 * (k + 1) for k in range(len(lp))])


async def test_the_turn_separator_is_a_mask_0_token_and_a_stop_string_gets_an_eos(qwen25_tokenizer) -> None:
    tok = qwen25_tokenizer
    gw, engine, store = _gateway(tok, [("I think. Observation:", "Observation:"), "ok"])
    session = store.create()
    first = await gw.complete(session, ChatCall(messages=[SYSTEM, USER], stop=("Observation:",)))
    assert first.content == "I think. " and first.matched_stop == "Observation:"
    follow = [SYSTEM, USER, assistant_message(first), {"role": "user", "content": "go on"}]
    await gw.complete(session, ChatCall(messages=follow))
    branch = session.branches[0]
    t0 = branch.turns[0]
    assert len(session.branches) == 1 and branch.turns[1].bridged
    eos_at = t0.end  # the model stopped at a stop string: the template's <|im_end|> is added, then "\n"
    assert branch.token_ids[eos_at] == tok.eos_token_id and branch.loss_mask[eos_at] == 0
    assert tok.decode(branch.token_ids[eos_at: branch.turns[1].start]).startswith("<|im_end|>\n<|im_start|>user")
    assert set(branch.loss_mask[eos_at: branch.turns[1].start]) == {0}


async def test_a_rewritten_last_turn_forks_at_the_first_differing_token(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    gw, engine, store = _gateway(tok, ["The answer is 20.", "again"])
    session = store.create()
    first = await gw.complete(session, ChatCall(messages=[SYSTEM, USER]))
    edited = {"role": "assistant", "content": "The answer is 21."}
    await gw.complete(session, ChatCall(messages=[SYSTEM, USER, edited, {"role": "user", "content": "sure?"}]))
    assert first.content == "The answer is 20." and len(session.branches) == 2
    root, fork = session.branches
    assert fork.parent == 0 and not fork.turns[-1].bridged
    assert fork.fork_at == common_prefix(root.token_ids, fork.token_ids) < len(root.token_ids)
    # the edit is where they part (digits are single tokens: "2" is shared, "0" / "1" differ)
    assert tok.decode(root.token_ids[fork.fork_at:]).startswith("0.")
    assert tok.decode(fork.token_ids[fork.fork_at:]).startswith("1.")
    # the shared prefix keeps the parent's data (loss weight belongs to the parent), the rest of the prompt is mask 0
    assert fork.loss_mask[: fork.fork_at] == root.loss_mask[: fork.fork_at]
    assert set(fork.loss_mask[fork.fork_at: fork.turns[-1].start]) == {0}


async def test_compaction_and_a_sub_agent_fork_from_the_shared_tokens(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    gw, engine, store = _gateway(tok, ["Step one done.", "summary seen", "sub-agent answer"])
    session = store.create()
    first = await gw.complete(session, ChatCall(messages=[SYSTEM, USER]))
    compacted = [SYSTEM, {"role": "user", "content": "Summary so far: step one done. Continue."}]
    await gw.complete(session, ChatCall(messages=compacted))
    sub = [{"role": "system", "content": "You are a sub-agent."}, {"role": "user", "content": "check 2+3"}]
    await gw.complete(session, ChatCall(messages=sub))
    assert first.content == "Step one done." and len(session.branches) == 3
    assert session.branches[1].parent == 0 and session.branches[1].fork_at > 0  # shares the system prompt
    assert session.branches[1].loss_mask[: session.branches[1].fork_at] == [0] * session.branches[1].fork_at
    assert session.branches[2].fork_at == common_prefix(session.branches[2].token_ids, session.branches[0].token_ids)


async def test_a_thinking_stripping_template_forks_on_a_new_user_turn_and_bridges_a_tool_result(
        thinking_tokenizer) -> None:
    tok = thinking_tokenizer
    gw, engine, store = _gateway(tok, ["<think>2+3=5</think>Calling.", "<think>ok</think>Five.", "again"])
    session = store.create()
    first = await gw.complete(session, ChatCall(messages=[SYSTEM, USER]))
    history = [SYSTEM, USER, assistant_message(first)]
    # a tool result after the last user message: the template keeps the thinking, so the tokens are kept
    await gw.complete(session, ChatCall(messages=[*history, {"role": "tool", "content": "5"}]))
    assert len(session.branches) == 1 and session.branches[0].turns[-1].bridged
    # a new user message: the template strips the earlier thinking, so the history is rendered in full and forks
    await gw.complete(session, ChatCall(messages=[*history, {"role": "user", "content": "why?"}]))
    assert len(session.branches) == 2
    fork = session.branches[1]
    assert not fork.turns[-1].bridged and fork.parent == 0
    assert tok.decode(session.branches[0].token_ids[fork.fork_at:]).startswith("<think>")
    assert "<think>2+3=5" not in tok.decode(fork.token_ids)


async def test_parallel_requests_in_one_session_each_get_their_branch(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    gw, engine, store = _gateway(tok, ["first", "left", "right"])
    session = store.create()
    first = await gw.complete(session, ChatCall(messages=[SYSTEM, USER]))
    engine.delay_s = 0.05
    history = [SYSTEM, USER, assistant_message(first)]
    left, right = await asyncio.gather(
        gw.complete(session, ChatCall(messages=[*history, {"role": "user", "content": "left?"}])),
        gw.complete(session, ChatCall(messages=[*history, {"role": "user", "content": "right?"}])))
    assert {left.content, right.content} == {"left", "right"}
    assert len(session.branches) == 2 and all(t.bridged for b in session.branches for t in b.turns[1:])
    a, b = session.branches
    assert b.parent == 0 and b.fork_at == common_prefix(a.token_ids, b.token_ids)
    assert a.token_ids[: a.turns[0].end] == b.token_ids[: a.turns[0].end]  # both kept the first turn's ids
    assert b.loss_mask[a.turns[0].start: a.turns[0].end] == [1] * (a.turns[0].end - a.turns[0].start)


async def test_a_retried_request_is_replayed_not_sampled_again(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    gw, engine, store = _gateway(tok, ["once", "twice"])
    session = store.create()
    call = ChatCall(messages=[SYSTEM, USER])
    one = await gw.complete(session, call, key="body-1")
    again = await gw.complete(session, call, key="body-1", retry=1)
    assert again == one and len(engine.prompts) == 1 and session.replayed == 1
    fresh = await gw.complete(session, call, key="body-1")  # same body, no retry header: a new sample
    assert fresh.content == "twice" and len(engine.prompts) == 2


async def test_a_retry_of_a_failed_request_generates_and_the_failure_is_recorded(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    gw, engine, store = _gateway(tok, ["ok"])
    session = store.create()
    real = engine.generate

    async def fail_once(*args, **kwargs):
        engine.generate = real
        raise EngineError("server restarting")

    engine.generate = fail_once
    call = ChatCall(messages=[SYSTEM, USER])
    with pytest.raises(EngineError):
        await gw.complete(session, call, key="k")
    again = await gw.complete(session, call, key="k", retry=1)  # the SDK's retry of the 503: a real generation
    assert again.content == "ok" and session.replayed == 0 and session.engine_errors == ["server restarting"]


async def test_a_cancelled_request_cancels_its_generation_and_commits_nothing(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    gw, engine, store = _gateway(tok, ["slow", "retried"], delay_s=10)
    session = store.create()
    task = asyncio.ensure_future(gw.complete(session, ChatCall(messages=[SYSTEM, USER]), key="k"))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.cancelled == 1 and session.branches == []
    engine.delay_s = 0
    redo = await gw.complete(session, ChatCall(messages=[SYSTEM, USER]), key="k", retry=1)
    assert redo.content == "retried" and len(session.branches) == 1


async def test_an_unreadable_tool_call_returns_the_text_marked_ill_formed(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    bad = '<tool_call>{"name": "add", "arguments": {"a": 2,</tool_call>'
    gw, engine, store = _gateway(tok, [bad, hermes_call_text("mul", {"a": 1}), "Sure." + CALL])
    session = store.create()
    out = await gw.complete(session, ChatCall(messages=[SYSTEM, USER], tools=TOOLS))
    assert out.ill_formed and out.content == bad and not out.tool_calls and out.finish_reason == "stop"
    assert session.branches[0].turns[0].ill_formed
    unknown = await gw.complete(session, ChatCall(messages=[SYSTEM, USER], tools=TOOLS))
    assert unknown.ill_formed  # a tool the request did not offer
    good = await gw.complete(session, ChatCall(messages=[SYSTEM, USER], tools=TOOLS))
    assert good.content == "Sure." and good.tool_calls[0].arguments == {"a": 2, "b": 3}


class PartsEngine:
    """Answers with the next ``(text, finish, version)``: ABORT parts are what a weight update cut off (no EOS),
    STOP parts end with EOS; logprobs numbered -0.01·(k+1) over all tokens sent; records prompts and budgets."""

    def __init__(self, tok: ChatTokenizer, parts: list[tuple[str, EngineFinish, int]]) -> None:
        self.tok, self.parts = tok, list(parts)
        self.calls: list[tuple[list[int], SamplingParams]] = []
        self._n = 0

    async def generate(self, input_ids, sampling: SamplingParams, *, sticky_key=None) -> GenerateResult:
        self.calls.append((list(input_ids), sampling))
        text, finish, version = self.parts.pop(0)
        ids = self.tok.encode_text(text) + ([self.tok.eos_token_id] if finish is EngineFinish.STOP else [])
        logprobs = [-0.01 * (self._n + k + 1) for k in range(len(ids))]
        self._n += len(ids)
        return GenerateResult(ids, logprobs, [version] * len(ids), finish,
                              matched_stop=self.tok.eos_token_id if finish is EngineFinish.STOP else None)


async def test_a_generation_the_engine_aborted_is_resumed_into_one_turn(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    head, tail = CALL[:17], CALL[17:]  # a weight update (v3 -> v4) cut the tool call in two
    engine = PartsEngine(tok, [(head, EngineFinish.ABORT, 3), (tail, EngineFinish.STOP, 4)])
    gw, store = Gateway(engine, tok, GatewayConfig(max_tokens=200)), SessionStore()
    session = store.create()
    done = await gw.complete(session, ChatCall(messages=[SYSTEM, USER], tools=TOOLS))
    assert done.finish_reason == "tool_calls" and done.tool_calls[0].arguments == {"a": 2, "b": 3}
    (first, s1), (second, s2) = engine.calls
    part1, part2 = tok.encode_text(head), tok.encode_text(tail) + [tok.eos_token_id]
    assert second == first + part1 and s2.max_new_tokens == s1.max_new_tokens - len(part1) == 200 - len(part1)
    (branch,) = session.branches
    assert len(branch.turns) == 1 and done.completion_tokens == len(part1) + len(part2)
    assert branch.token_ids == first + part1 + part2
    assert branch.loss_mask == [0] * len(first) + [1] * (len(part1) + len(part2))
    n = len(part1) + len(part2)
    assert branch.logprobs[len(first):] == [-0.01 * (k + 1) for k in range(n)]
    assert branch.weight_versions[len(first):] == [3] * len(part1) + [4] * len(part2)


async def test_an_aborted_generation_is_resumed_as_often_as_allowed_but_never_a_grammar(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    aborted = [("The", EngineFinish.ABORT, 3)] * 2
    gw, store = Gateway(PartsEngine(tok, aborted), tok, GatewayConfig(max_resumes=1)), SessionStore()
    session = store.create()
    with pytest.raises(EngineError, match="aborted the generation 2 times"):
        await gw.complete(session, ChatCall(messages=[SYSTEM, USER]))
    assert session.branches == [] and len(session.engine_errors) == 1

    engine = PartsEngine(tok, [("ab", EngineFinish.ABORT, 3), ("ab", EngineFinish.STOP, 4)])
    gw, store = Gateway(engine, tok, GatewayConfig()), SessionStore()
    session = store.create()
    with pytest.raises(EngineError, match="constrained .* cannot be resumed"):
        await gw.complete(session, ChatCall(messages=[SYSTEM, USER], regex="(ab)+"))
    assert len(engine.calls) == 1 and session.branches == []
