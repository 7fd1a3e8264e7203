"""One multi-turn episode, token-in/token-out, written as a small explicit state machine.

    GENERATE ──(turn ended: EOS or a tool's stop string)──► ACT ──(observation)──► GENERATE
        │ budget/length/abort-limit                          │ done / no tool call / budget
        ▼                                                    ▼
       DONE ◄────────────────────────────────────────────── DONE

Invariants of the trajectory built here (see agentrl.types): ``token_ids`` is the prompt followed by exactly the
token ids the engine returned and the observation tokens appended (never re-tokenised); ``loss_mask`` is 1 on
engine tokens only; ``behavior_logprobs`` and ``weight_versions`` come from the engine, per token. A request the
engine aborted (e.g. for a weight update) is continued from where it stopped, so one turn can span versions.
Every trajectory carries a real score: a reward that could not be computed raises :class:`~agentrl.errors.RewardError` instead.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from agentrl.async_rollout.config import EpisodeBudget
from agentrl.engine.base import EngineFinish, InferenceEngine, PrefillEngine, SamplingParams
from agentrl.env.base import Environment, Observation
from agentrl.rewards.base import RewardInput
from agentrl.tokenizer import ChatTokenizer
from agentrl.types import FinishReason, Task, ToolCall, ToolResult, Trajectory, Turn

logger = logging.getLogger(__name__)


class AgentState(enum.Enum):
    GENERATE = "generate"
    ACT = "act"
    DONE = "done"


@dataclass
class _State:
    """Mutable per-episode buffers; frozen into a Trajectory at the end."""

    token_ids: list[int]
    prompt_len: int
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    turn_start: int = 0
    turn_text: str = ""
    turn_gen_s: float = 0.0
    finish: FinishReason = FinishReason.STOP
    resumes: int = 0

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        self.loss_mask = [0] * n
        self.logprobs = [0.0] * n
        self.versions = [-1] * n
        self.turn_start = n

    @property
    def response_len(self) -> int:
        return len(self.token_ids) - self.prompt_len


class SharedPrefill:
    """Prefills a prompt once for the samples of a group. They start together with the same prompt and go to the same
    server (one routing key), and SGLang matches its prefix cache when it schedules a request: none of them is cached
    before their common batch has run, so each sample would prefill the whole prompt (8 samples, 8 prefills: in short
    multi-turn episodes prefill is most of the rollout side's compute). The first sample of a (key, prompt) asks the
    engine to prefill it alone; the others wait for that one request and then find the prompt cached. A failed or
    interrupted prefill costs only the saving: the samples then generate as they would have."""

    def __init__(self, engine: PrefillEngine, capacity: int = 4096) -> None:
        self.engine = engine
        self.capacity = capacity
        self._pending: OrderedDict[tuple[str, int, int], asyncio.Future[None]] = OrderedDict()

    async def __call__(self, key: str, input_ids: Sequence[int]) -> None:
        entry = (key, len(input_ids), hash(tuple(input_ids)))
        shared = self._pending.get(entry)
        if shared is None:
            shared = self._pending[entry] = asyncio.ensure_future(self.engine.prefill(input_ids, sticky_key=key))
            # forgotten once done: a sample that comes later, or the group retried after a weight update flushed the
            # cache, prefills again (a cached prompt costs SGLang one token)
            shared.add_done_callback(lambda done: self._forget(entry, done))
            while len(self._pending) > self.capacity:
                self._pending.popitem(last=False)
        try:
            await asyncio.shield(shared)  # one sample restarted for new weights must not cancel the others' prefill
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # this sample is cancelled; the prefill goes on for the others
            logger.debug("shared prefill for %s was cancelled", key)  # the prefill was: generate without it
        except Exception as exc:  # noqa: BLE001  # any failure: generate without it (the generate call reports its own)
            logger.debug("shared prefill for %s failed: %s", key, exc)

    def _forget(self, entry: tuple[str, int, int], done: asyncio.Future[None]) -> None:
        if self._pending.get(entry) is done:
            del self._pending[entry]
        if not done.cancelled():
            done.exception()  # retrieved: no "exception was never retrieved" when every waiter was cancelled


class EpisodeRunner:
    """Runs episodes of any :class:`Environment` against an :class:`InferenceEngine`."""

    def __init__(self, engine: InferenceEngine, tokenizer: ChatTokenizer, sampling: SamplingParams,
                 budget: EpisodeBudget = EpisodeBudget(), *, share_prefill: bool = False) -> None:
        """``share_prefill``: prefill the first prompt of the episodes of a group once (:class:`SharedPrefill`), for
        runners whose groups hold several samples, on an engine that can (:class:`PrefillEngine`)."""
        self.engine = engine
        self.tok = tokenizer
        self.sampling = sampling
        self.budget = budget
        self.shared_prefill = SharedPrefill(engine) if share_prefill and isinstance(engine, PrefillEngine) else None

    async def run(self, env: Environment, task: Task, *, env_name: str = "", group_id: str = "",
                  trajectory_id: str | None = None) -> Trajectory:
        """Run one episode to the end and score it. Infrastructure failures raise (the caller retries or drops
        the sample): engine and sandbox errors as they come, a reward that could not be computed as
        :class:`~agentrl.errors.RewardError`. A returned trajectory always has a real score."""
        messages = await env.reset(task)
        st = _State(token_ids=self.tok.encode_prompt(messages, env.tool_schemas() or None), prompt_len=0)
        st.prompt_len = len(st.token_ids)
        tid = trajectory_id or Trajectory.new_id()
        # routing key: every turn of the episode — and every sample of its group, which share the prompt — goes to
        # the same server, so its prefix cache is reused
        key = group_id or tid
        state = AgentState.GENERATE
        if st.prompt_len >= self.budget.max_context_tokens:
            st.finish, state = FinishReason.LENGTH, AgentState.DONE
        elif self.shared_prefill is not None and group_id:
            await self.shared_prefill(key, st.token_ids)
        while state is not AgentState.DONE:
            state = await (self._generate(st, env, key) if state is AgentState.GENERATE else self._act(st, env))
        result = (await env.score(RewardInput.from_turns(st.turns, st.finish))).raise_for_status(
            f"episode {tid} (task {task.id!r})")
        breakdown = result.details.get("breakdown") or {env_name or env.name or "reward": result.score}
        return Trajectory(
            trajectory_id=tid, prompt_id=task.id, group_id=group_id or task.id,
            # lists: Trajectory freezes its arrays from any sequence (types._readonly_array)
            token_ids=st.token_ids, prompt_len=st.prompt_len, loss_mask=st.loss_mask,  # type: ignore[arg-type]
            behavior_logprobs=st.logprobs, weight_versions=st.versions,  # type: ignore[arg-type]
            reward=result.score, finish_reason=st.finish,
            reward_breakdown={k: float(v) for k, v in breakdown.items()}, turns=tuple(st.turns), env=env_name,
            metadata={"answer": task.answer},
        )

    async def episode(self, env: Environment, task: Task, *, env_name: str = "",
                      group_id: str = "") -> list[Trajectory]:
        """:meth:`run` as the scheduler calls every runner: an episode's trajectories (here always one)."""
        return [await self.run(env, task, env_name=env_name, group_id=group_id)]

    def _remaining(self, st: _State) -> int:
        return min(self.budget.max_response_tokens - st.response_len,
                   self.budget.max_context_tokens - len(st.token_ids))

    async def _generate(self, st: _State, env: Environment, key: str) -> AgentState:
        remaining = self._remaining(st)
        if remaining <= 0:
            st.finish = FinishReason.LENGTH
            return self._end_turn(st)
        sampling = replace(self.sampling, max_new_tokens=min(self.sampling.max_new_tokens, remaining),
                           stop=tuple(dict.fromkeys((*self.sampling.stop, *env.stop))))
        t0 = time.monotonic()
        out = await self.engine.generate(st.token_ids, sampling, sticky_key=key)
        st.turn_gen_s += time.monotonic() - t0
        st.token_ids.extend(out.output_ids)
        st.loss_mask.extend([1] * len(out.output_ids))
        st.logprobs.extend(out.logprobs)
        st.versions.extend(out.weight_versions)
        st.turn_text += self.tok.decode(out.output_ids)
        if out.finish is EngineFinish.ABORT:
            st.resumes += 1
            if st.resumes > self.budget.max_resumes:
                st.finish = FinishReason.ABORTED
                return self._end_turn(st)
            return AgentState.GENERATE  # continue the same turn, possibly on new weights
        if out.finish is EngineFinish.LENGTH:
            st.finish = FinishReason.LENGTH
            return self._end_turn(st)
        return AgentState.ACT

    async def _act(self, st: _State, env: Environment) -> AgentState:
        t0 = time.monotonic()
        result = await env.step(st.turn_text)
        tool_s = time.monotonic() - t0
        obs_ids = self._observation_ids(st, result.observation) if result.observation is not None else []
        if result.done or result.observation is None:
            over_budget = any(r.status == "budget" for r in result.tool_results)
            st.finish = FinishReason.MAX_TURNS if over_budget else FinishReason.STOP
            return self._end_turn(st, result.tool_calls, result.tool_results, tool_s)
        if len(st.turns) + 1 >= self.budget.max_turns:
            st.finish = FinishReason.MAX_TURNS
            return self._end_turn(st, result.tool_calls, result.tool_results, tool_s)
        if len(obs_ids) >= self._remaining(st):
            st.finish = FinishReason.LENGTH
            return self._end_turn(st, result.tool_calls, result.tool_results, tool_s)
        self._end_turn(st, result.tool_calls, result.tool_results, tool_s, observation_len=len(obs_ids))
        st.token_ids.extend(obs_ids)
        st.loss_mask.extend([0] * len(obs_ids))
        st.logprobs.extend([0.0] * len(obs_ids))
        st.versions.extend([-1] * len(obs_ids))
        st.turn_start = len(st.token_ids)
        return AgentState.GENERATE

    def _observation_ids(self, st: _State, obs: Observation) -> list[int]:
        """Observation tokens: raw text as is; chat messages as the template's delta after a finished assistant
        message — so an EOS is added first (mask 0) when the model's turn ended at a stop string instead."""
        ids: list[int] = []
        if obs.text:
            ids += self.tok.encode_text(obs.text)
        if obs.messages:
            last = ids[-1] if ids else st.token_ids[-1]
            if last != self.tok.eos_token_id:
                ids.append(self.tok.eos_token_id)
            ids += self.tok.encode_messages_delta(obs.messages)
        return ids

    def _end_turn(self, st: _State, calls: tuple[ToolCall, ...] = (), results: tuple[ToolResult, ...] = (),
                  tool_s: float = 0.0, *, observation_len: int = 0) -> AgentState:
        st.turns.append(Turn(
            index=len(st.turns), text=st.turn_text, token_start=st.turn_start,
            token_end=len(st.token_ids), observation_len=observation_len,
            tool_calls=calls, tool_results=results, generate_s=st.turn_gen_s, tool_s=tool_s,
        ))
        st.turn_text, st.turn_gen_s = "", 0.0
        return AgentState.DONE
