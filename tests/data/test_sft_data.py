"""agentrl.data.sft: conversations tokenised with a rollout's token boundaries (assistant text scored, interpreter
spans masked), pre-tokenised rows, truncation that counts instead of dropping, and clear errors."""

from __future__ import annotations

import asyncio
import copy
import json
import re
from pathlib import Path

import pytest

from agentrl.async_rollout.episode import EpisodeRunner
from agentrl.data.loader import DatasetError
from agentrl.data.sft import (
    check_sft_data,
    load_sft_traces,
    read_traces,
    split_observations,
    tokenize_conversation,
    write_traces,
)
from agentrl.engine.base import EngineFinish, GenerateResult, SamplingParams
from agentrl.env.registry import EnvResources
from agentrl.env.retool import ReToolEnv, format_interpreter
from agentrl.rewards import MathVerifier
from agentrl.sandbox import make_sandbox
from agentrl.tokenizer import ChatTokenizer, tokenize_trace
from agentrl.types import Task

SPAN_1 = "\n<interpreter>\n42\n</interpreter>\n"
SPAN_2 = "\n<interpreter>\n49\n</interpreter>\n"
TURN_1 = ["Let me compute.\n<code>\nprint(6 * 7)\n</code>", SPAN_1, "So \\boxed{42}."]
TURN_2 = ["<code>\nprint(42 + 7)\n</code>", SPAN_2, "It is \\boxed{49}."]
CONVERSATION = [
    {"role": "system", "content": "Use Python."},
    {"role": "user", "content": "What is 6 * 7?"},
    {"role": "assistant", "content": "".join(TURN_1)},
    {"role": "user", "content": "Add 7."},
    {"role": "assistant", "content": "".join(TURN_2)},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_split_observations_cuts_exactly_the_envs_observation_text() -> None:
    assert SPAN_1 == format_interpreter("42")  # the spans are what the ReTool env appends
    assert split_observations("".join(TURN_1)) == [(TURN_1[0], True), (SPAN_1, False), (TURN_1[2], True)]
    assert split_observations("no tools") == [("no tools", True)]
    assert split_observations("a<interpreter>\nx") == [("a", True), ("<interpreter>\nx", False)]  # unclosed


def test_interpreter_spans_are_masked_and_assistant_text_scored(tmp_path: Path, chat_tokenizer: ChatTokenizer) -> None:
    tok = chat_tokenizer
    path = write_jsonl(tmp_path / "sft.jsonl", [{"messages": CONVERSATION}])
    (trace,), stats = load_sft_traces(path, tok, max_tokens=4096)
    enc = tok.encode_text
    span_tokens = len(enc(SPAN_1)) + len(enc(SPAN_2))
    assert trace.observation_tokens == span_tokens == stats.observation_tokens > 0
    # the exact layout: prompt | model text | span | model text | EOS | next user turn + header | ... | EOS
    prompt = enc(tok.render(CONVERSATION[:2], add_generation_prompt=True))
    between = tok.render(CONVERSATION[:4], add_generation_prompt=True)[
        len(tok.render(CONVERSATION[:3], add_generation_prompt=False).rstrip("\n")):]
    expected = [(prompt, 0), (enc(TURN_1[0]), 1), (enc(SPAN_1), 0), (enc(TURN_1[2]), 1), ([tok.eos_token_id], 1),
                (enc(between), 0), (enc(TURN_2[0]), 1), (enc(SPAN_2), 0), (enc(TURN_2[2]), 1),
                ([tok.eos_token_id], 1)]
    assert trace.token_ids == [t for ids, _ in expected for t in ids]
    assert trace.loss_mask == [m for ids, m in expected for _ in ids]
    scored = sum(len(ids) for ids, m in expected if m)
    assert stats.model_tokens == scored == sum(trace.loss_mask)
    assert stats.traces == 1 and stats.truncated == 0
    # masked tokens after the prompt: the two spans and the user turn between the assistant turns, nothing else
    assert trace.loss_mask[len(prompt):].count(0) == span_tokens + len(enc(between))
    # the pieces add up to the chat template's render of the whole conversation
    assert tok.decode(trace.token_ids) == tok.render(CONVERSATION, add_generation_prompt=False).rstrip("\n")


def test_a_single_turn_conversation_matches_the_generated_trace_layout(chat_tokenizer: ChatTokenizer) -> None:
    trace = tokenize_conversation(chat_tokenizer, CONVERSATION[:3])
    ids, mask = tokenize_trace(chat_tokenizer, CONVERSATION[:2], [(TURN_1[0], True), (SPAN_1, False),
                                                                   (TURN_1[2], True)])
    assert (trace.token_ids, trace.loss_mask) == (ids, mask)


async def test_an_sft_trace_has_the_token_boundaries_of_a_rollout(chat_tokenizer: ChatTokenizer) -> None:
    """The ReTool env, the real local sandbox and a scripted engine that writes the assistant's text: the
    trajectory's tokens and loss mask equal the SFT trace of the same conversation."""
    tok = chat_tokenizer

    class Scripted:
        def __init__(self) -> None:
            self.turns = [(TURN_1[0], False), (TURN_1[2], True)]

        async def generate(self, input_ids, sampling, *, sticky_key=None):
            text, eos = self.turns.pop(0)
            ids = tok.encode_text(text) + ([tok.eos_token_id] if eos else [])
            return GenerateResult(ids, [-0.5] * len(ids), [0] * len(ids), EngineFinish.STOP)

    sandbox = make_sandbox("local", max_concurrency=1)
    verifier = MathVerifier(workers=1)
    await verifier.start()
    try:
        task = Task(id="t", prompt="What is 6 * 7?", answer="42", messages=tuple(CONVERSATION[:2]))
        async with ReToolEnv(EnvResources(sandbox=sandbox, verifier=verifier), system_prompt="ignored") as env:
            traj = await asyncio.wait_for(EpisodeRunner(Scripted(), tok, SamplingParams()).run(env, task), 120)
    finally:
        await verifier.aclose()
        await sandbox.aclose()
    trace = tokenize_conversation(tok, CONVERSATION[:3])
    assert traj.turns[0].tool_results[0].output.strip() == "42"
    assert list(traj.token_ids) == trace.token_ids
    assert list(traj.loss_mask) == trace.loss_mask


def test_pretokenised_rows_are_used_as_they_are(tmp_path: Path, chat_tokenizer: ChatTokenizer) -> None:
    rows = [{"token_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}, {"token_ids": [5, 6], "loss_mask": [0, 1]}]
    path = write_jsonl(tmp_path / "tok.jsonl", rows)
    check_sft_data(path)
    traces, stats = load_sft_traces(path, chat_tokenizer, max_tokens=3)
    assert [(t.token_ids, t.loss_mask) for t in traces] == [([1, 2, 3], [0, 0, 1]), ([5, 6], [0, 1])]
    assert (stats.traces, stats.truncated, stats.truncated_tokens, stats.tokens) == (2, 1, 1, 5)
    out = write_traces(traces, tmp_path / "sft_traces.jsonl")  # the trainer's hand-off file reads back
    assert [(t.token_ids, t.loss_mask) for t in read_traces(out)] == [(t.token_ids, t.loss_mask) for t in traces]


@pytest.mark.parametrize("row, words", [
    ({"token_ids": [1, 2], "loss_mask": [1]}, "one per token id"),
    ({"token_ids": [1, 2], "loss_mask": [1, 2]}, "list of 0/1"),
    ({"token_ids": [1, 10**9], "loss_mask": [1, 1]}, "token ids in [0, "),
])
def test_bad_pretokenised_rows(tmp_path: Path, chat_tokenizer: ChatTokenizer, row: dict, words: str) -> None:
    with pytest.raises(DatasetError, match=re.escape(words)):
        load_sft_traces(write_jsonl(tmp_path / "bad.jsonl", [row]), chat_tokenizer, max_tokens=64)


def test_long_conversations_are_truncated_and_counted_never_dropped(tmp_path: Path,
                                                                    chat_tokenizer: ChatTokenizer) -> None:
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    path = write_jsonl(tmp_path / "sft.jsonl", [{"messages": CONVERSATION}, {"messages": short}])
    full, _ = load_sft_traces(path, chat_tokenizer, max_tokens=10_000)
    limit = len(full[1].token_ids)
    traces, stats = load_sft_traces(path, chat_tokenizer, max_tokens=limit)
    assert len(traces) == 2 and traces[1] == full[1]
    assert traces[0].token_ids == full[0].token_ids[:limit] and traces[0].loss_mask == full[0].loss_mask[:limit]
    assert (stats.truncated, stats.truncated_tokens) == (1, len(full[0].token_ids) - limit)


@pytest.mark.parametrize("rows, kwargs, words", [
    ([{"mesages": CONVERSATION}], {}, "did you mean messages_key='mesages'?"),
    ([{"conversation": CONVERSATION}], {"messages_key": "messages"}, "or give token_ids and loss_mask"),
    ([{"messages": CONVERSATION[:2]}], {}, "no assistant message"),
    ([{"messages": [{"from": "human", "value": "hi"}]}], {}, "not a {role, content} mapping"),
])
def test_sft_data_errors_name_the_file_and_key(tmp_path: Path, chat_tokenizer: ChatTokenizer, rows, kwargs,
                                               words: str) -> None:
    path = write_jsonl(tmp_path / "sft.jsonl", rows)
    with pytest.raises(DatasetError, match=re.escape(words)) as info:
        check_sft_data(path, **kwargs)
    assert str(path) in str(info.value) and info.value.field == "messages_key"
    with pytest.raises(DatasetError, match=re.escape(words)):
        load_sft_traces(path, chat_tokenizer, max_tokens=64, **kwargs)


def test_a_template_that_rerenders_earlier_turns_is_refused(tmp_path: Path, chat_tokenizer: ChatTokenizer) -> None:
    """Like templates that drop earlier reasoning: SFT on it would learn boundaries no rollout has."""
    hf = copy.deepcopy(chat_tokenizer.hf)
    hf.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}(earlier){% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = ChatTokenizer(hf)
    tokenize_conversation(tok, CONVERSATION[:3])  # one assistant turn: fine
    path = write_jsonl(tmp_path / "sft.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(DatasetError, match="row 0: the chat template renders the turns before message 4 differently"):
        load_sft_traces(path, tok, max_tokens=4096)
