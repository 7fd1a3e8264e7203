"""The gateway's core: one chat request → prompt ids (bridged or rendered in full) → the engine → a committed
branch → a :class:`Completion`. Transport-free: the OpenAI and Anthropic routes are thin translations.

Prompt rule (the heart of token continuity, see :mod:`agentrl.gateway.session`): if the request's messages are a
stored conversation prefix ending with an assistant message the gateway answered, followed by user/tool messages,
the prompt is that prefix's stored tokens (the ids the model sampled, verbatim; an EOS added with mask 0 if the
turn ended otherwise) + the chat template's delta for the tail (``ChatTokenizer.encode_continuation``, which also
checks that the template keeps the history as it was, e.g. does not strip earlier thinking). Anything else is
rendered in full; the commit then forks at the first token that differs from every stored branch.

``tool_choice`` ``"required"`` or a named function is enforced by a grammar of the builtin ``<tool_call>`` format
(:mod:`agentrl.gateway.tool_choice`); with another tool parser it is refused (HTTP 400).

SDK retries (``x-stainless-retry-count`` ≥ 1 with the same body) get the first answer again, never a second
sample (a first attempt that failed is not replayed: the retry generates); cancelling a request (its client
disconnected) cancels its generation, which the engine client aborts on the server.

Budgets (:class:`SessionLimits`): a request past the turn budget, or whose prompt fills the context, is answered
with no text and ``finish_reason="length"`` and generates nothing; otherwise ``max_tokens`` is clamped to the
context that remains.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from agentrl.engine.base import EngineFinish, InferenceEngine, SamplingParams
from agentrl.env.tool_parsers import ToolParser, make_tool_parser
from agentrl.errors import EngineError
from agentrl.gateway.base import CallOut, ChatCall, Completion, FinishReason, GatewayConfig, SessionLimits
from agentrl.gateway.messages import prefix_keys
from agentrl.gateway.session import Sampled, Session, TurnRecord
from agentrl.gateway.tool_choice import constrain
from agentrl.tokenizer import ChatTokenizer

logger = logging.getLogger(__name__)

_BRIDGEABLE = ("user", "tool")


class Gateway:
    """Answers chat requests of sessions with an inference engine (an ``SGLangClient`` or an ``EnginePool``)."""

    def __init__(self, engine: InferenceEngine, tokenizer: ChatTokenizer, config: GatewayConfig | None = None):
        self.engine, self.tok, self.config = engine, tokenizer, config or GatewayConfig()
        self._parsers: OrderedDict[tuple[str, ...], ToolParser] = OrderedDict()
        make_tool_parser(self.config.tool_parser, [])  # an unknown parser name fails here, not on a request

    async def complete(self, session: Session, call: ChatCall, *, key: str = "", retry: int = 0) -> Completion:
        """Answer ``call`` in ``session``. ``key`` identifies the request body: a retry (``retry`` ≥ 1) of a body
        already answered, or still being answered, gets that answer."""
        session.check_open()
        call = constrain(call, self.config.tool_parser)
        session.requests += 1
        first = session.replies.get(key) if retry and key else None
        if first is not None and not first.cancelled() and not (first.done() and first.exception() is not None):
            session.replayed += 1
            return await asyncio.shield(first)
        task = asyncio.ensure_future(self._complete(session, call))
        session.inflight.add(task)
        task.add_done_callback(session.inflight.discard)
        if key and session.replay_size:
            session.replies[key] = task
            while len(session.replies) > session.replay_size:
                session.replies.popitem(last=False)
        try:
            return await task  # cancelling this await cancels the generation
        except EngineError as exc:
            session.engine_errors.append(str(exc))
            raise

    async def _complete(self, session: Session, call: ChatCall) -> Completion:
        limits = session.limits
        if limits.max_turns is not None and session.generations >= limits.max_turns:
            session.exhausted = "max_turns"
            return Completion("", (), "length", prompt_tokens=0, completion_tokens=0)
        keys = prefix_keys(call.messages, call.tools)
        prompt, bridged = self.prompt_ids(session, call, keys)
        call = _within(call, limits, len(prompt), self.config.max_tokens)
        if call.max_tokens is not None and call.max_tokens <= 0:
            session.exhausted = "length"
            return Completion("", (), "length", prompt_tokens=len(prompt), completion_tokens=0)
        session.generations += 1
        sampled, finish, matched = await self._generate(session, prompt, call)
        completion = self._answer(call, sampled, finish, matched, len(prompt))
        record = TurnRecord(0, 0, completion.finish_reason, completion.ill_formed, len(completion.tool_calls),
                            bridged, tuple((c.name, dict(c.arguments)) for c in completion.tool_calls))
        branch = session.commit(prompt, sampled, record)
        session.remember(prefix_keys([assistant_message(completion)], [], seed=keys[-1])[-1], branch.index,
                         record.end)
        return replace(completion, branch=branch.index)

    def prompt_ids(self, session: Session, call: ChatCall, keys: list[str] | None = None) -> tuple[list[int], bool]:
        """The prompt's token ids and whether they were bridged from stored tokens (see the module docstring)."""
        msgs = call.messages
        keys = keys or prefix_keys(msgs, call.tools)
        j = len(msgs)
        while j > 0 and msgs[j - 1]["role"] in _BRIDGEABLE:
            j -= 1
        if 0 < j < len(msgs) and msgs[j - 1]["role"] == "assistant":
            stored = session.bridge_tokens(keys[j])
            if stored:
                delta = self.tok.encode_continuation(msgs[:j], msgs[j:], call.tools or None)
                if delta is not None:
                    eos = [] if stored[-1] == self.tok.eos_token_id else [self.tok.eos_token_id]
                    return stored + eos + delta, True
        return self.tok.encode_prompt(msgs, call.tools or None), False

    async def _generate(self, session: Session, prompt: list[int],
                        call: ChatCall) -> tuple[Sampled, EngineFinish, str | int | None]:
        budget = call.max_tokens or self.config.max_tokens
        sampling = SamplingParams(max_new_tokens=budget, temperature=call.temperature, top_p=call.top_p,
                                  stop=call.stop, regex=call.regex, ebnf=call.ebnf, seed=call.seed)
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        resumes = self.config.max_resumes if session.limits.max_resumes is None else session.limits.max_resumes
        for attempt in range(resumes + 1):
            out = await self.engine.generate(prompt + ids, replace(sampling, max_new_tokens=budget - len(ids)),
                                             sticky_key=session.id)
            ids += out.output_ids
            logprobs += out.logprobs
            versions += out.weight_versions
            if out.finish is not EngineFinish.ABORT:
                return Sampled(ids, logprobs, versions), out.finish, out.matched_stop
            if len(ids) >= budget:
                return Sampled(ids, logprobs, versions), EngineFinish.LENGTH, None
            if call.regex or call.ebnf:  # the grammar's state is lost: sampling on would break the constraint
                raise EngineError(f"session {session.id}: the engine aborted a constrained (regex/ebnf) generation, "
                                  "which cannot be resumed mid-way; send the request again")
            logger.debug("session %s: generation aborted by the engine (resume %d)", session.id, attempt + 1)
        raise EngineError(f"session {session.id}: the engine aborted the generation "
                          f"{resumes + 1} times; try again")

    def _answer(self, call: ChatCall, sampled: Sampled, finish: EngineFinish, matched: str | int | None,
                prompt_len: int) -> Completion:
        ids = sampled.ids
        if ids and finish is EngineFinish.STOP and (ids[-1] == self.tok.eos_token_id or isinstance(matched, int)):
            ids = ids[:-1]  # the end-of-turn token is not part of the message
        text = self.tok.decode(ids)
        stop = matched if isinstance(matched, str) else None
        if stop and text.endswith(stop):
            text = text[: -len(stop)]  # as OpenAI: the stop sequence is not returned
        reason: FinishReason = "length" if finish is EngineFinish.LENGTH else "stop"

        def answer(content: str, calls: tuple[CallOut, ...] = (), ill_formed: bool = False) -> Completion:
            return Completion(content, calls, "tool_calls" if calls else reason, prompt_tokens=prompt_len,
                              completion_tokens=len(sampled.ids), matched_stop=stop, ill_formed=ill_formed)

        if not call.tools or call.tool_choice == "none":
            return answer(text)
        parsed = self._parser(call).parse(text)
        if not parsed:
            return answer(text)
        names = {t["function"]["name"] for t in call.tools}
        if any(p.error is not None or p.name not in names for p in parsed):
            return answer(text, ill_formed=True)  # the model's mistake: its text as is, the turn marked
        if all(p.raw and p.raw in text for p in parsed):
            content = text
            for p in parsed:
                content = content.replace(p.raw, "", 1)
        else:  # SGLang's parsers do not say where a call was: the text before the first one
            content = text[: _first_marker(text)]
        return answer(content.strip(), tuple(CallOut(f"call_{uuid.uuid4().hex[:24]}", p.name, p.arguments)
                                             for p in parsed))

    def _parser(self, call: ChatCall) -> ToolParser:
        key = (self.config.tool_parser, *sorted(t["function"]["name"] for t in call.tools))
        parser = self._parsers.get(key)
        if parser is None:
            parser = self._parsers[key] = make_tool_parser(self.config.tool_parser, call.tools)
            while len(self._parsers) > 256:
                self._parsers.popitem(last=False)
        return parser


def _within(call: ChatCall, limits: SessionLimits, prompt_len: int, default_max_tokens: int) -> ChatCall:
    """``call`` with the session's sampling imposed and ``max_tokens`` clamped to its budget (≤ 0: no room)."""
    if limits == SessionLimits():
        return call
    budget = call.max_tokens or default_max_tokens
    if limits.max_new_tokens is not None:
        budget = min(budget, limits.max_new_tokens)
    if limits.max_context_tokens is not None:
        budget = min(budget, limits.max_context_tokens - prompt_len)
    return replace(call, max_tokens=budget,
                   temperature=call.temperature if limits.temperature is None else limits.temperature,
                   top_p=call.top_p if limits.top_p is None else limits.top_p)


def _first_marker(text: str) -> int:
    from agentrl.env.sglang_parsers import CALL_MARKERS

    found = [i for m in {*CALL_MARKERS.values(), "<tool_call>"} if (i := text.find(m)) >= 0]
    return min(found) if found else len(text)


def assistant_message(completion: Completion) -> dict[str, Any]:
    """The assistant message a client sends back for ``completion`` (the gateway's form)."""
    msg: dict[str, Any] = {"role": "assistant", "content": completion.content}
    if completion.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in completion.tool_calls]
    return msg
