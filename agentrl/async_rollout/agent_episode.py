"""Agent episodes: a user's agent function (:mod:`agentrl.env.agent`) run against the in-process agent gateway,
its session's token branches turned into trajectories.

One episode = one gateway session:

    open session (budget: max turns, context, the run's sampling) ─► await env.run(task, client), within timeout_s
        ─► close session (in-flight generations aborted) ─► score the result ─► one trajectory per branch

The scheduler treats it like a native episode: same admission, per-token versions (the engine's, stamped at
dispatch), interruptible weight updates (an aborted generation is resumed by the gateway), restarts (cancelling the
episode cancels the agent and closes its session), retries of infrastructure failures.

**Loss weight of shared tokens.** A branch forked from ``parent`` at ``fork_at`` repeats the parent's first
``fork_at`` tokens; where the parent trains a token (mask 1) the child's mask is zeroed, so every sampled token is
trained once. With at most ``max_branches`` branches kept (the first ``max_branches - 1`` and the one the agent
finished on), a child of a dropped branch is compared with its nearest kept ancestor over the prefix all of them
share (the minimum ``fork_at`` along the way). All branches of an episode carry its reward; each counts as a sample
of the group (so its GRPO baseline weighs an episode by its branches).

Evaluations (:mod:`agentrl.eval.runner`) use the same runner through :func:`served_agents` (a gateway of their own,
one branch kept per sample) or, for a model agentrl does not serve, :func:`run_agent_at` (the agent's client
pointed at that server: its result scored, no tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from agentrl.async_rollout.config import EpisodeBudget
from agentrl.engine.base import InferenceEngine, SamplingParams
from agentrl.env.agent import AgentEnv, AgentError, AgentOutcome, ClientConfig
from agentrl.env.tool_parsers import BUILTIN
from agentrl.errors import AgentRLError, ConfigError, EngineError
from agentrl.gateway.base import GatewayConfig, SessionLimits, SessionNotFound
from agentrl.gateway.local import LocalGateway
from agentrl.gateway.session import Branch, Session
from agentrl.tokenizer import ChatTokenizer
from agentrl.types import FinishReason, Task, ToolCall, Trajectory, Turn

logger = logging.getLogger(__name__)

_ENDS = {"max_turns": FinishReason.MAX_TURNS, "length": FinishReason.LENGTH}


class AgentRunner:
    """Runs agent episodes through ``gateway`` (started by the caller, shared by all episodes)."""

    def __init__(self, gateway: LocalGateway, tokenizer: ChatTokenizer, sampling: SamplingParams,
                 budget: EpisodeBudget = EpisodeBudget()) -> None:
        self.gateway, self.tok, self.budget = gateway, tokenizer, budget
        self.limits = SessionLimits.for_episode(budget, sampling)

    async def episode(self, env: Any, task: Task, *, env_name: str = "", group_id: str = "",
                      trajectory_id: str = "") -> list[Trajectory]:
        """Run the agent once on ``task``; its branches as trajectories (see the module docstring). Raises what
        an infrastructure failure raises (:class:`AgentError`, engine errors, :class:`~agentrl.errors.RewardError`)."""
        if not isinstance(env, AgentEnv):
            raise ConfigError(f"the agent runner runs agent environments (@agentrl.agent), got {type(env).__name__}")
        tid = trajectory_id or Trajectory.new_id()
        session = self.gateway.store.create({"task": task.id, "group": group_id, "trajectory": tid},
                                            limits=self.limits)
        result, error = await self._run_agent(env, task, session, self._client(session))
        if error is not None and session.engine_errors:
            raise EngineError(f"agent episode {tid} (task {task.id!r}): the engine failed under the agent "
                              f"({session.engine_errors[-1]}), which then raised {error}")
        if not session.branches:
            raise AgentError(f"agent {env.name!r} made no chat request for task {task.id!r} "
                             f"({error or 'it returned ' + repr(result)[:200]}); an agent must send its requests "
                             "to client.base_url")
        last = session.branches[session.last_branch or 0]
        finish = _ENDS.get(session.exhausted or "") or _finish(last)
        text = _text(result) if result is not None else self._last_text(last)
        outcome = AgentOutcome(result, text, session.reward, dict(session.metrics), finish, error)
        scored = (await env.score(task, outcome)).raise_for_status(f"agent episode {tid} (task {task.id!r})")
        breakdown = {k: float(v) for k, v in (scored.details.get("breakdown") or {}).items()}
        meta = {"answer": task.answer, "session": session.id, "branches": len(session.branches)}
        if error is not None:
            meta["agent_error"] = error[:500]
        return branch_trajectories(session.branches, self.tok, keep=self.budget.max_branches, last=last.index,
                                   trajectory_id=tid, task=task, group_id=group_id or task.id, env=env_name,
                                   reward=scored.score, breakdown=breakdown or {env_name or "reward": scored.score},
                                   finish=finish, metadata=meta)

    def _client(self, session: Session) -> ClientConfig:
        base = self.gateway.base_url(session)
        return ClientConfig(base_url=base, api_key=session.api_key, model=self.gateway.gateway.config.model_name,
                            anthropic_base_url=base.removesuffix("/v1"),
                            reward_url=base.removesuffix("/v1") + "/reward", session_id=session.id,
                            http_client=self.gateway.http_client,
                            anthropic_http_client=self.gateway.anthropic_http_client)

    async def _run_agent(self, env: AgentEnv, task: Task, session: Session,
                         client: ClientConfig) -> tuple[Any, str | None]:
        """The agent's result, or what it raised; the session is closed (its generations aborted) either way."""
        try:
            return await _call_agent(env, task, client)
        finally:
            try:
                await self.gateway.store.close(session.id)
            except SessionNotFound:
                pass  # the agent finalized or aborted it itself

    def _last_text(self, branch: Branch) -> str:
        if not branch.turns:
            return ""
        turn = max(branch.turns, key=lambda t: t.end)
        return _turn_text(self.tok, branch.token_ids[turn.start:turn.end])


@contextlib.asynccontextmanager
async def served_agents(engine: InferenceEngine, tokenizer: ChatTokenizer, sampling: SamplingParams,
                        budget: EpisodeBudget = EpisodeBudget(), *, model_name: str = "agentrl",
                        tool_parser: str = BUILTIN) -> AsyncIterator[AgentRunner]:
    """An :class:`AgentRunner` with a gateway of its own on loopback for the block (an evaluation's; a training
    run serves one gateway for all its episodes)."""
    config = GatewayConfig(model_name=model_name, tool_parser=tool_parser)  # max_resumes: the session's limits
    async with LocalGateway(engine, tokenizer, config) as gateway:
        yield AgentRunner(gateway, tokenizer, sampling, budget)


@dataclass(frozen=True, slots=True)
class DirectEpisode:
    """An agent run straight against a model's own OpenAI-compatible server (no gateway): no tokens, no turns
    seen, nothing posted; what it returned, as text, and its reward."""

    trajectory_id: str
    text: str
    reward: float
    reward_breakdown: dict[str, float]
    error: str | None = None  # what the agent raised
    finish_reason: FinishReason = FinishReason.STOP
    turns: tuple[Turn, ...] = ()


async def run_agent_at(env: Any, task: Task, client: ClientConfig, *, trajectory_id: str = "") -> DirectEpisode:
    """Run the agent once with ``client`` pointing at a model's server directly (evaluating a model agentrl does
    not serve) and score its result with the environment's reward. Raises ConfigError for an agent whose reward
    is only what it posts (there is no session to post to), :class:`AgentError` when it does not return within
    its ``timeout_s``, :class:`RewardError` when the reward could not be computed."""
    if not isinstance(env, AgentEnv):
        raise ConfigError(f"run_agent_at runs agent environments (@agentrl.agent), got {type(env).__name__}")
    if env.reward is None:
        raise ConfigError(f"agent {env.name!r} is scored only by the reward it posts, and an agent run against a "
                          "model's own server has no session to post to; give it a reward (reward: math, or a "
                          "function) to evaluate it there")
    result, error = await _call_agent(env, task, client)
    text = _text(result) if result is not None else ""
    scored = (await env.score(task, AgentOutcome(result, text, error=error))).raise_for_status(
        f"agent {env.name!r} on task {task.id!r}")
    breakdown = {k: float(v) for k, v in (scored.details.get("breakdown") or {}).items()}
    return DirectEpisode(trajectory_id or Trajectory.new_id(), text, scored.score, breakdown, error)


async def _call_agent(env: AgentEnv, task: Task, client: ClientConfig) -> tuple[Any, str | None]:
    """The agent's result, or what it raised (the model's doing: scored); :class:`AgentError` past its time."""
    deadline = asyncio.timeout(env.timeout_s)
    try:
        async with deadline:
            return await env.run(task, client), None
    except TimeoutError:
        if deadline.expired():
            raise AgentError(f"agent {env.name!r} did not return within {env.timeout_s:.0f}s (task "
                             f"{task.id!r}); raise the environment's timeout_s if it needs longer") from None
        return None, "TimeoutError: the agent's own timeout"
    except AgentRLError:
        raise
    except Exception as exc:  # the agent broke, often on the model's output: the sample is scored
        logger.info("agent %s raised on task %s: %r", env.name, task.id, exc)
        return None, f"{type(exc).__name__}: {exc}"


def _text(result: Any) -> str:
    if isinstance(result, str):
        return result
    content = getattr(result, "final_output", None)  # e.g. an OpenAI Agents SDK RunResult
    return str(content if content is not None else result)


def _turn_text(tok: ChatTokenizer, ids: list[int]) -> str:
    return tok.decode(ids[:-1] if ids and ids[-1] == tok.eos_token_id else ids)


def _finish(branch: Branch) -> FinishReason:
    reason = max(branch.turns, key=lambda t: t.end).finish_reason if branch.turns else "stop"
    return FinishReason.LENGTH if reason == "length" else FinishReason.STOP


def owned_masks(branches: Sequence[Branch], keep: set[int]) -> dict[int, list[int]]:
    """The loss masks of the kept branches, each shared token trained in one branch only (module docstring)."""
    masks: dict[int, list[int]] = {}
    for b in branches:
        if b.index not in keep:
            continue
        mask = list(b.loss_mask)
        shared, anc = b.fork_at, b.parent
        while anc is not None and anc not in keep:
            shared, anc = min(shared, branches[anc].fork_at), branches[anc].parent
        if anc is not None:
            theirs = branches[anc].loss_mask
            for i in range(shared):
                if theirs[i]:
                    mask[i] = 0
        masks[b.index] = mask
    return masks


def branch_trajectories(branches: Sequence[Branch], tok: ChatTokenizer, *, keep: int, last: int,
                        trajectory_id: str, task: Task, group_id: str, env: str, reward: float,
                        breakdown: dict[str, float], finish: FinishReason,
                        metadata: dict[str, Any]) -> list[Trajectory]:
    """One trajectory per kept branch that trains at least one token; ``finish`` goes to branch ``last`` (the
    one the agent ended on), the others end as their last turn did."""
    kept = {b.index for b in branches[: keep - 1]} | {last} if len(branches) > keep else {b.index for b in branches}
    masks = owned_masks(branches, kept)
    out = []
    for b in branches:
        mask = masks.get(b.index)
        if mask is None or not any(mask):
            continue
        out.append(Trajectory(
            trajectory_id=f"{trajectory_id}-{b.index}" if len(branches) > 1 else trajectory_id,
            # lists: Trajectory freezes its arrays from any sequence (types._readonly_array)
            prompt_id=task.id, group_id=group_id, token_ids=b.token_ids, prompt_len=b.prompt_len, loss_mask=mask,  # type: ignore[arg-type]
            behavior_logprobs=b.logprobs, weight_versions=b.weight_versions, reward=reward,  # type: ignore[arg-type]
            finish_reason=finish if b.index == last else _finish(b), reward_breakdown=breakdown,
            turns=_turns(b, tok), env=env,
            metadata={**metadata, "branch": b.index, "parent": b.parent, "fork_at": b.fork_at,
                      "branches_dropped": len(branches) - len(kept)}))
    return out


def _turns(branch: Branch, tok: ChatTokenizer) -> tuple[Turn, ...]:
    records = sorted({(t.start, t.end): t for t in branch.turns}.values(), key=lambda t: t.start)
    turns = []
    for i, r in enumerate(records):
        nxt = records[i + 1].start if i + 1 < len(records) else r.end
        calls = tuple(ToolCall(name, args) for name, args in r.calls)
        if r.ill_formed:
            calls += (ToolCall("", {}, error="the model's tool call could not be read"),)
        turns.append(Turn(index=i, text=_turn_text(tok, branch.token_ids[r.start:r.end]),
                          token_start=r.start, token_end=r.end, observation_len=max(0, nxt - r.end),
                          tool_calls=calls))
    return tuple(turns)
