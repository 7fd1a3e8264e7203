"""SFT traces from a user's data: chat conversations or pre-tokenised rows → ``(token_ids, loss_mask)``.

A dataset (any format of :mod:`agentrl.data.loader`) holds either

- conversations: a ``messages`` column (the key is configurable) of chat messages ``{role, content}``. The loss
  is on the assistant's own tokens only: the prompt, user and tool turns, and the ``<interpreter>…</interpreter>``
  spans inside assistant turns (ReTool's sandbox output, which the model never writes) have loss mask 0; or
- pre-tokenised rows: ``token_ids`` and ``loss_mask`` (same length, 1 = learn this token), used as they are.

Traces longer than ``max_tokens`` are cut to their first ``max_tokens`` tokens; they are counted
(:class:`SFTDataStats`), never dropped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agentrl.data.loader import DatasetError, chat_messages, first_row, get_key, has_key, iter_rows, missing_key_error
from agentrl.tokenizer import ChatTokenizer

#: an interpreter observation inside an assistant turn, with the newline before and after it: exactly the text the
#: ReTool environment appends (``agentrl.retool_format.format_interpreter``); unclosed, it runs to the turn's end
INTERPRETER_SPAN = re.compile(r"\n?<interpreter>.*?(?:</interpreter>\n?|\Z)", re.S)
PRETOKENISED = ("token_ids", "loss_mask")


@dataclass(frozen=True, slots=True)
class SFTTrace:
    """One SFT example. ``observation_tokens``: tokens of interpreter spans inside assistant turns (mask 0)."""

    token_ids: list[int]
    loss_mask: list[int]
    observation_tokens: int = 0


@dataclass(frozen=True, slots=True)
class SFTDataStats:
    """What a traces file holds. ``truncated`` traces were longer than ``max_tokens`` and lost
    ``truncated_tokens`` tokens in all; ``model_tokens`` are the tokens with loss mask 1 (after truncation)."""

    source: str
    traces: int
    tokens: int
    model_tokens: int
    observation_tokens: int
    truncated: int
    truncated_tokens: int
    max_tokens: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def split_observations(text: str) -> list[tuple[str, bool]]:
    """``(text, is_model)`` parts of an assistant turn's text: interpreter spans (:data:`INTERPRETER_SPAN`) are
    not the model's; empty parts are left out."""
    parts: list[tuple[str, bool]] = []
    pos = 0
    for m in INTERPRETER_SPAN.finditer(text):
        if m.start() > pos:
            parts.append((text[pos:m.start()], True))
        parts.append((m.group(0), False))
        pos = m.end()
    if pos < len(text):
        parts.append((text[pos:], True))
    return parts


def tokenize_conversation(tok: ChatTokenizer, messages: Sequence[Mapping[str, Any]]) -> SFTTrace:
    """Token ids and loss mask of a conversation, with the token boundaries a rollout produces.

    Pieces, each tokenised on its own (``encode_text``) as the episode runner does: the chat-template render of
    the messages before an assistant turn with its generation prompt (for the first turn: the prompt; later: the
    user/tool turns after the previous EOS, like ``ChatTokenizer.encode_messages_delta``), mask 0; then the
    assistant's text split by :func:`split_observations` (model text mask 1, interpreter spans mask 0, as the
    ReTool env appends them between two generate calls); then EOS (mask 1: the model learns to stop).

    The template is rendered incrementally and checked: each prefix render must start with the text of the
    pieces so far, each assistant turn must render as its text followed by EOS, and the pieces' text is a prefix
    of the full render (the rest is what the template writes after the last EOS, e.g. a newline, which the model
    never generates). A template that re-renders earlier turns (say, one that drops earlier reasoning) fails
    with a ``ValueError`` instead of training on boundaries no rollout has. Messages after the last assistant
    turn carry nothing to learn and are left out."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    if last < 0:
        raise ValueError("the conversation holds no assistant message (nothing to learn)")
    if messages[0].get("role") == "assistant":
        raise ValueError("the conversation starts with an assistant message; it needs a prompt before it")
    ids: list[int] = []
    mask: list[int] = []
    observed = 0
    text = ""  # the text of the pieces so far
    for k in range(last + 1):
        if messages[k].get("role") != "assistant":
            continue
        prefix = tok.render(messages[:k], add_generation_prompt=True)
        if not prefix.startswith(text):
            raise ValueError(f"the chat template renders the turns before message {k} differently once more "
                             "turns follow; token boundaries would differ from a rollout's")
        piece = tok.encode_text(prefix[len(text):])
        ids += piece
        mask += [0] * len(piece)
        turn = tok.render(messages[: k + 1], add_generation_prompt=False)
        end = turn.find(tok.eos_token, len(prefix))
        if not turn.startswith(prefix) or end < 0:
            raise ValueError(f"the chat template does not render assistant message {k} as its text followed by "
                             f"{tok.eos_token!r} after the generation prompt")
        for part, is_model in split_observations(turn[len(prefix):end]):
            piece = tok.encode_text(part)
            ids += piece
            mask += [int(is_model)] * len(piece)
            observed += 0 if is_model else len(piece)
        ids.append(tok.eos_token_id)
        mask.append(1)
        text = turn[: end + len(tok.eos_token)]
    full = tok.render(messages[: last + 1], add_generation_prompt=False)
    if not full.startswith(text):
        raise ValueError("the pieces do not add up to the chat template's render of the whole conversation")
    return SFTTrace(ids, mask, observed)


def _pretokenised(row: Mapping[str, Any], where: str, vocab: int) -> SFTTrace:
    ids, mask = row["token_ids"], row["loss_mask"]
    if not isinstance(ids, list | tuple) or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
        raise DatasetError(f"{where}: token_ids must be a list of token ids in [0, {vocab})", field="path")
    if not isinstance(mask, list | tuple) or len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
        raise DatasetError(f"{where}: loss_mask must be a list of 0/1, one per token id ({len(ids)})", field="path")
    if not ids:
        raise DatasetError(f"{where}: token_ids is empty", field="path")
    return SFTTrace(list(map(int, ids)), [int(m) for m in mask])


def _conversation(row: Mapping[str, Any], where: str, messages_key: str) -> tuple[dict[str, Any], ...]:
    messages = chat_messages(get_key(row, messages_key), f"{where}, {messages_key!r}", field="messages_key")
    if not any(m["role"] == "assistant" for m in messages):
        raise DatasetError(f"{where}: the conversation holds no assistant message (nothing to learn)",
                           field="messages_key")
    return messages


def _kind(path: str | Path, row: Mapping[str, Any], messages_key: str) -> str:
    if has_key(row, messages_key):
        return "messages"
    if all(k in row for k in PRETOKENISED):
        return "tokens"
    raise missing_key_error(path, row, messages_key, "messages_key",
                            "chat messages {role, content}; or give token_ids and loss_mask columns")


def check_sft_data(path: str | Path, *, messages_key: str = "messages") -> None:
    """Cheap check (first row only) that ``path`` holds conversations under ``messages_key`` or pre-tokenised
    rows. Raises :class:`agentrl.data.loader.DatasetError`."""
    row = first_row(path)
    where = f"dataset {path}, row 0"
    if _kind(path, row, messages_key) == "messages":
        _conversation(row, where, messages_key)
    else:
        _pretokenised(row, where, vocab=2**31)


def truncate(traces: Sequence[SFTTrace], max_tokens: int, source: str) -> tuple[list[SFTTrace], SFTDataStats]:
    """Traces cut to their first ``max_tokens`` tokens, and the counts (see :class:`SFTDataStats`)."""
    out: list[SFTTrace] = []
    cut = cut_tokens = 0
    for t in traces:
        if len(t.token_ids) > max_tokens:
            cut += 1
            cut_tokens += len(t.token_ids) - max_tokens
            t = SFTTrace(t.token_ids[:max_tokens], t.loss_mask[:max_tokens], t.observation_tokens)
        out.append(t)
    return out, SFTDataStats(source=source, traces=len(out), tokens=sum(len(t.token_ids) for t in out),
                             model_tokens=sum(sum(t.loss_mask) for t in out),
                             observation_tokens=sum(t.observation_tokens for t in out), truncated=cut,
                             truncated_tokens=cut_tokens, max_tokens=max_tokens)


def load_sft_traces(path: str | Path, tok: ChatTokenizer, *, messages_key: str = "messages",
                    max_tokens: int) -> tuple[list[SFTTrace], SFTDataStats]:
    """Every row of an SFT dataset as a trace (conversations tokenised by :func:`tokenize_conversation`), cut to
    ``max_tokens``."""
    traces: list[SFTTrace] = []
    kind = None
    for i, row in enumerate(iter_rows(path)):
        where = f"dataset {path}, row {i}"
        kind = kind or _kind(path, row, messages_key)
        if kind == "tokens":
            traces.append(_pretokenised(row, where, vocab=len(tok.hf)))
            continue
        try:
            traces.append(tokenize_conversation(tok, _conversation(row, where, messages_key)))
        except ValueError as exc:
            if isinstance(exc, DatasetError):
                raise
            raise DatasetError(f"{where}: {exc}", field="messages_key") from exc
    return truncate(traces, max_tokens, str(path))


def write_traces(traces: Sequence[SFTTrace], out: Path) -> Path:
    """The hand-off to the trainer: one ``{"token_ids", "loss_mask"}`` JSON object per line (pre-tokenised rows;
    :func:`read_traces` reads them back)."""
    import json

    with open(out, "w") as f:
        for t in traces:
            f.write(json.dumps({"token_ids": t.token_ids, "loss_mask": t.loss_mask}) + "\n")
    return out


def read_traces(path: str | Path) -> list[SFTTrace]:
    """The traces :func:`write_traces` wrote, read through the one dataset loader (:mod:`agentrl.data.loader`)
    and checked as pre-tokenised rows (token ids are not checked against a vocabulary: we wrote them)."""
    return [_pretokenised(row, f"dataset {path}, row {i}", vocab=2**31) for i, row in enumerate(iter_rows(path))]
