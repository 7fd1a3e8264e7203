"""One episode through a chat-completions engine: the same environments, rewards and budgets as
:mod:`agentrl.async_rollout.episode`, at the level of text (messages in, assistant text out). For evaluating a
model agentrl does not serve; nothing here is trainable (no token ids, logprobs or weight versions).

    GENERATE ──(turn ended: EOS or a tool's stop string)──► ACT ──(observation)──► GENERATE
        │ budget / length                                    │ done / no tool call / budget
        ▼                                                    ▼
       DONE ◄────────────────────────────────────────────── DONE

How the conversation maps to chat messages — an approximation of the token-exact path, which renders one
growing token sequence:

- each model turn is one ``assistant`` message holding the turn's text (a stop string that ended it included);
- an observation given as raw text (ReTool's ``<interpreter>…</interpreter>``, which the token path appends
  inside the same assistant message) becomes a ``user`` message with that text, and the model answers in a new
  assistant message;
- an observation given as chat messages (a ``tool`` turn) is sent as those messages; when the server returned
  structured ``tool_calls``, the assistant message carries them and each tool message its ``tool_call_id``, and
  the environment reads them as ``<tool_call>{"name": …, "arguments": …}</tool_call>`` text (the built-in parser's
  format) after the turn's content;
- the environment's tool schemas go in the request's ``tools``; token budgets use the server's ``usage`` counts
  (when it reports none, only ``max_new_tokens`` per turn and ``max_turns`` bound the episode).
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field, replace
from typing import Any

from agentrl.async_rollout.config import EpisodeBudget
from agentrl.engine.base import ChatEngine, ChatResult, EngineFinish, SamplingParams
from agentrl.env.base import Environment, Observation
from agentrl.rewards.base import RewardInput
from agentrl.types import FinishReason, Task, ToolCall, ToolResult, Trajectory, Turn


class ChatState(enum.Enum):
    GENERATE = "generate"
    ACT = "act"
    DONE = "done"


@dataclass(frozen=True, slots=True)
class ChatEpisode:
    """A finished chat episode. Token counts are the server's ``usage`` (0 when it reports none):
    ``prompt_tokens`` of the first request, ``completion_tokens`` summed over turns, ``context_tokens`` of the
    last request (prompt + completion). ``turns`` have no token positions (``token_start == token_end == 0``)."""

    trajectory_id: str
    reward: float
    reward_breakdown: dict[str, float]
    finish_reason: FinishReason
    turns: tuple[Turn, ...]
    messages: tuple[dict[str, Any], ...]  # the conversation, the last assistant message included
    prompt_tokens: int = 0
    completion_tokens: int = 0
    context_tokens: int = 0


@dataclass
class _State:
    messages: list[dict[str, Any]]
    turns: list[Turn] = field(default_factory=list)
    last: ChatResult | None = None
    turn_gen_s: float = 0.0
    finish: FinishReason = FinishReason.STOP
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    context_tokens: int = 0


def tool_call_text(name: str, arguments: str) -> str:
    """A structured tool call as the built-in parser's ``<tool_call>`` text (``arguments``: JSON text)."""
    try:
        args: Any = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        args = arguments  # kept as the model wrote it: the environment reports it malformed
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n</tool_call>"


class ChatEpisodeRunner:
    """Runs episodes of any :class:`Environment` against a :class:`ChatEngine` (see the module docstring)."""

    def __init__(self, engine: ChatEngine, sampling: SamplingParams, budget: EpisodeBudget = EpisodeBudget()) -> None:
        self.engine = engine
        self.sampling = sampling
        self.budget = budget

    async def run(self, env: Environment, task: Task, *, env_name: str = "",
                  trajectory_id: str | None = None) -> ChatEpisode:
        """Run one episode and score it. Engine and sandbox failures raise as they come; a reward that could not
        be computed raises :class:`~agentrl.errors.RewardError`; a returned episode always has a real score."""
        st = _State(messages=[dict(m) for m in await env.reset(task)])
        tid = trajectory_id or Trajectory.new_id()
        tools = env.tool_schemas()
        state = ChatState.GENERATE
        while state is not ChatState.DONE:
            state = await (self._generate(st, env, tools) if state is ChatState.GENERATE else self._act(st, env))
        reward_input = replace(RewardInput.from_turns(st.turns, st.finish), response_tokens=st.completion_tokens)
        result = (await env.score(reward_input)).raise_for_status(f"episode {tid} (task {task.id!r})")
        breakdown = result.details.get("breakdown") or {env_name or env.name or "reward": result.score}
        return ChatEpisode(
            trajectory_id=tid, reward=result.score, reward_breakdown={k: float(v) for k, v in breakdown.items()},
            finish_reason=st.finish, turns=tuple(st.turns), messages=tuple(st.messages),
            prompt_tokens=st.prompt_tokens or 0, completion_tokens=st.completion_tokens,
            context_tokens=st.context_tokens)

    def _remaining(self, st: _State) -> int:
        if st.prompt_tokens is None:  # no usage reported (yet): only max_new_tokens bounds a turn
            return self.sampling.max_new_tokens
        return min(self.budget.max_response_tokens - (st.context_tokens - st.prompt_tokens),
                   self.budget.max_context_tokens - st.context_tokens)

    async def _generate(self, st: _State, env: Environment, tools: list[dict[str, Any]]) -> ChatState:
        remaining = self._remaining(st)
        if remaining <= 0:
            st.finish = FinishReason.LENGTH
            return self._end_turn(st, "")
        sampling = replace(self.sampling, max_new_tokens=min(self.sampling.max_new_tokens, remaining),
                           stop=tuple(dict.fromkeys((*self.sampling.stop, *env.stop))))
        t0 = time.monotonic()
        out = await self.engine.chat(st.messages, sampling, tools=tools)
        st.turn_gen_s += time.monotonic() - t0
        st.last = out
        if out.prompt_tokens is not None:
            st.prompt_tokens = out.prompt_tokens if st.prompt_tokens is None else st.prompt_tokens
            st.context_tokens = out.prompt_tokens + (out.completion_tokens or 0)
        st.completion_tokens += out.completion_tokens or 0
        st.messages.append(_assistant_message(out))
        if out.finish is EngineFinish.LENGTH:
            st.finish = FinishReason.LENGTH
            return self._end_turn(st, _turn_text(out))
        return ChatState.ACT

    async def _act(self, st: _State, env: Environment) -> ChatState:
        last = st.last
        text = _turn_text(last) if last is not None else ""
        t0 = time.monotonic()
        result = await env.step(text)
        tool_s = time.monotonic() - t0
        if result.done or result.observation is None:
            over_budget = any(r.status == "budget" for r in result.tool_results)
            st.finish = FinishReason.MAX_TURNS if over_budget else FinishReason.STOP
            return self._end_turn(st, text, result.tool_calls, result.tool_results, tool_s)
        if len(st.turns) + 1 >= self.budget.max_turns:
            st.finish = FinishReason.MAX_TURNS
            return self._end_turn(st, text, result.tool_calls, result.tool_results, tool_s)
        self._end_turn(st, text, result.tool_calls, result.tool_results, tool_s)
        st.messages.extend(_observation_messages(result.observation, last))
        return ChatState.GENERATE

    def _end_turn(self, st: _State, text: str, calls: tuple[ToolCall, ...] = (),
                  results: tuple[ToolResult, ...] = (), tool_s: float = 0.0) -> ChatState:
        st.turns.append(Turn(index=len(st.turns), text=text, token_start=0, token_end=0, tool_calls=calls,
                             tool_results=results, generate_s=st.turn_gen_s, tool_s=tool_s))
        st.turn_gen_s, st.last = 0.0, None
        return ChatState.DONE


def _turn_text(out: ChatResult) -> str:
    """What the environment reads: the content, then structured tool calls as ``<tool_call>`` text."""
    return "\n".join([out.text, *(tool_call_text(c.name, c.arguments) for c in out.tool_calls)]) \
        if out.tool_calls else out.text


def _assistant_message(out: ChatResult) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": out.text}
    if out.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in out.tool_calls]
    return msg


def _observation_messages(obs: Observation, out: ChatResult | None) -> list[dict[str, Any]]:
    """The observation as chat messages (see the module docstring)."""
    messages: list[dict[str, Any]] = []
    if obs.text:
        messages.append({"role": "user", "content": obs.text.strip("\n")})
    ids = [c.id for c in out.tool_calls] if out is not None else []
    for m in obs.messages:
        msg = dict(m)
        if msg.get("role") == "tool" and ids:  # the OpenAI schema of a tool message: role, content, tool_call_id
            msg.pop("name", None)
            msg["tool_call_id"] = ids.pop(0)
        messages.append(msg)
    return messages
