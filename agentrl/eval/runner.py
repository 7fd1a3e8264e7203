"""Run an evaluation: ``samples_per_item`` episodes per item, bounded concurrency, metrics over the records.

The one evaluator of agentrl: the REST service, ``agentrl eval`` and a training run's held-out evaluation all
run here. :func:`run_eval` runs an :class:`EvalSpec` (the REST/YAML boundary); :func:`run_plan` runs an
:class:`EvalPlan`, the spec's in-process form (what running needs: environment, sampling, budgets, retries),
which a caller with its own validated config builds directly. Both take everything else as arguments (engine,
tokenizer, environment resources). The engine is token-level (an :class:`InferenceEngine` and its tokenizer:
episodes of :mod:`agentrl.async_rollout.episode`, records with trajectories) or a :class:`ChatEngine`
(episodes of :mod:`agentrl.async_rollout.chat_episode`, records with ``token_level: false`` and a transcript). A run resumes: samples given in ``completed`` are not run again and count in
the metrics. It stops early, with the records so far, when ``cancel`` is set.

An agent environment (``@agentrl.agent``) runs the user's agent function instead: on a token-level engine through
a gateway served for the run (one session per sample; the record's trajectory is the branch the agent ended on,
all its sampled tokens), on a chat engine (``openai_url``) with the agent's client pointed at that server itself
(records ``token_level: false``, no transcript: the agent's requests go past agentrl; the response is what the
agent returned).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from agentrl.async_rollout.agent_episode import AgentRunner, DirectEpisode, run_agent_at, served_agents
from agentrl.async_rollout.chat_episode import ChatEpisode, ChatEpisodeRunner
from agentrl.async_rollout.episode import EpisodeBudget, EpisodeRunner
from agentrl.engine.base import ChatEndpoint, ChatEngine, InferenceEngine, SamplingParams
from agentrl.env.agent import ClientConfig
from agentrl.env.registry import EnvResources, Registry, default_registry
from agentrl.env.tool_parsers import BUILTIN
from agentrl.errors import ConfigError, InfrastructureError
from agentrl.eval.base import (
    EvalResult,
    RecordCallback,
    SampleRecord,
    SpecError,
    UnknownEnvironmentError,
    finite,
)
from agentrl.eval.datasets import load_tasks
from agentrl.eval.metrics import compute_metrics, item_groups
from agentrl.eval.spec import EvalSpec
from agentrl.rewards.base import RewardInput, is_correct
from agentrl.tokenizer import ChatTokenizer
from agentrl.types import Task, Trajectory

logger = logging.getLogger(__name__)


class TooManyErrors(InfrastructureError):
    """Samples kept failing in a row (engine or sandbox down?): the evaluation stops instead of recording more."""


async def check_environment(spec: EvalSpec, resources: EnvResources, registry: Registry = default_registry) -> None:
    """Raise :class:`UnknownEnvironmentError`, or a SpecError naming ``environment.options``, if the
    environment cannot be built as specified (one instance is built and closed)."""
    known = tuple(e.name for e in registry.list_envs())
    if spec.environment.name not in known:
        raise UnknownEnvironmentError(spec.environment.name, known)
    try:
        env = registry.make_env(spec.environment.name, resources, **spec.environment.options)
    except (ConfigError, TypeError, ValueError) as exc:
        raise SpecError(("environment", "options"), str(exc)) from None
    await env.close()


@dataclass(frozen=True, slots=True)
class EvalPlan:
    """How an evaluation runs its samples (the fields mean what :class:`EvalSpec`'s do). ``sampling.seed``, when
    set, is a base: sample ``s`` of item ``i`` uses ``seed + i * samples_per_item + s``. ``None`` for
    ``max_consecutive_errors`` or ``episode_timeout_s``: no such limit."""

    env_name: str
    sampling: SamplingParams
    budget: EpisodeBudget
    env_options: Mapping[str, Any] = field(default_factory=dict)
    samples_per_item: int = 1
    pass_k: tuple[int, ...] = (1,)
    correct_threshold: float = 1.0
    max_concurrency: int = 8
    sample_retries: int = 1
    max_consecutive_errors: int | None = 16
    episode_timeout_s: float | None = 600.0
    keep_trajectories: bool = True
    group_by: str | None = None  # an item metadata key: metrics per group too

    @classmethod
    def of(cls, spec: EvalSpec) -> EvalPlan:
        sp = spec.sampling
        return cls(
            env_name=spec.environment.name, env_options=dict(spec.environment.options),
            sampling=SamplingParams(max_new_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p,
                                    top_k=sp.top_k, stop=tuple(sp.stop), seed=sp.seed),
            budget=EpisodeBudget(max_turns=spec.max_turns, max_response_tokens=spec.max_response_tokens,
                                 max_context_tokens=spec.max_context_tokens),
            samples_per_item=spec.samples_per_item, pass_k=tuple(spec.pass_k),
            correct_threshold=spec.correct_threshold, max_concurrency=spec.max_concurrency,
            sample_retries=spec.sample_retries, max_consecutive_errors=spec.max_consecutive_errors,
            episode_timeout_s=spec.episode_timeout_s, keep_trajectories=spec.keep_trajectories,
            group_by=spec.group_by)


@dataclass(frozen=True, slots=True)
class _Job:
    item_index: int
    sample_index: int
    task: Task


def _scored(job: _Job, episode: Trajectory | ChatEpisode | DirectEpisode, *, threshold: float, attempts: int,
            duration_s: float) -> dict[str, Any]:
    """The fields of an ok record that both kinds of episode share (reward, correctness, turns, tool calls)."""
    turns = episode.turns
    calls = [c for t in turns for c in t.tool_calls]
    results = [r for t in turns for r in t.tool_results]
    bad = sum(1 for c in calls if c.error is not None) + sum(1 for r in results if not r.ok and r.status != "malformed")
    breakdown = {k: v for k, v in episode.reward_breakdown.items() if finite(v) is not None}
    return {"item_index": job.item_index, "sample_index": job.sample_index, "task_id": job.task.id, "status": "ok",
            "reward": finite(episode.reward), "correct": is_correct(episode.reward, breakdown, threshold),
            "reward_breakdown": breakdown, "finish_reason": episode.finish_reason.value, "num_turns": len(turns),
            "num_tool_calls": len(calls), "num_tool_errors": bad, "duration_s": round(duration_s, 4),
            "attempts": attempts, "prompt": job.task.prompt, "answer": job.task.answer,
            "response": RewardInput.from_turns(turns).text}


def to_record(job: _Job, traj: Trajectory, *, threshold: float, attempts: int, duration_s: float,
              keep_trajectory: bool) -> SampleRecord:
    return SampleRecord(
        **_scored(job, traj, threshold=threshold, attempts=attempts, duration_s=duration_s),
        prompt_tokens=traj.prompt_len, response_tokens=traj.num_tokens - traj.prompt_len,
        model_tokens=traj.num_model_tokens, trajectory=_finite_trajectory(traj) if keep_trajectory else None)


def to_chat_record(job: _Job, ep: ChatEpisode, *, threshold: float, attempts: int, duration_s: float,
                   keep_transcript: bool) -> SampleRecord:
    """The record of a chat-completions episode: ``token_level`` False, token counts from the server's usage."""
    return SampleRecord(
        **_scored(job, ep, threshold=threshold, attempts=attempts, duration_s=duration_s),
        prompt_tokens=ep.prompt_tokens, response_tokens=max(0, ep.context_tokens - ep.prompt_tokens),
        model_tokens=ep.completion_tokens, token_level=False,
        transcript=[dict(m) for m in ep.messages] if keep_transcript else None)


def to_agent_record(job: _Job, ep: DirectEpisode, *, threshold: float, attempts: int,
                    duration_s: float) -> SampleRecord:
    """The record of an agent run against a chat engine's server: ``token_level`` False, no token counts, the
    response is what the agent returned."""
    scored = _scored(job, ep, threshold=threshold, attempts=attempts, duration_s=duration_s)
    return SampleRecord(**{**scored, "response": ep.text}, token_level=False)


def _finite_trajectory(traj: Trajectory) -> dict[str, object]:
    """``Trajectory.to_dict()`` for JSON readers: turns as objects with named fields, NaN/inf as null."""
    d = traj.to_dict()
    d["behavior_logprobs"] = [finite(x) for x in d["behavior_logprobs"]]
    d["reward"] = finite(traj.reward)
    d["reward_breakdown"] = {k: finite(v) for k, v in traj.reward_breakdown.items()}
    d["turns"] = [t.as_dict() for t in traj.turns]
    return d


class _Run:
    """The state of one :func:`run_plan` call."""

    def __init__(self, plan: EvalPlan, engine: InferenceEngine | ChatEngine, tokenizer: ChatTokenizer | None,
                 resources: EnvResources, registry: Registry, on_record: RecordCallback | None,
                 limiter: asyncio.Semaphore | None, id_prefix: str, keep_records: bool) -> None:
        self.chat = not isinstance(engine, InferenceEngine)
        if self.chat and not isinstance(engine, ChatEngine):
            raise ConfigError(f"{type(engine).__name__} is neither an InferenceEngine (generate) nor a ChatEngine "
                              "(chat)")
        if not self.chat and tokenizer is None:
            raise ConfigError("a token-level engine needs its model's tokenizer (tokenizer=...)")
        self.plan, self.engine, self.tok, self.resources, self.registry = plan, engine, tokenizer, resources, registry
        self.on_record, self.limiter, self.id_prefix = on_record, limiter, id_prefix
        self.keep_records = keep_records  # False: trajectories are not held in memory (on_record has them)
        self.records: list[SampleRecord] = []
        self.failed_in_a_row = 0
        self.local = asyncio.Semaphore(plan.max_concurrency)
        self.agent = registry.get_env(plan.env_name).kind == "agent"
        self.agents: AgentRunner | None = None  # agent episodes on a token-level engine (set by run_plan)

    def _sampling(self, job: _Job) -> SamplingParams:
        p = self.plan
        seed = p.sampling.seed
        if seed is not None:
            seed += job.item_index * p.samples_per_item + job.sample_index
        return replace(p.sampling, seed=seed)

    async def _episode(self, job: _Job) -> Trajectory | ChatEpisode | DirectEpisode:
        env = self.registry.make_env(self.plan.env_name, self.resources, **self.plan.env_options)
        tid = f"{self.id_prefix}{job.item_index}-{job.sample_index}"
        async with env:
            async with asyncio.timeout(self.plan.episode_timeout_s):
                if self.agents is not None:
                    return (await self.agents.episode(env, job.task, env_name=self.plan.env_name,
                                                      group_id=f"{self.id_prefix}{job.item_index}",
                                                      trajectory_id=tid))[-1]
                if self.agent:
                    end = await _endpoint(self.engine)
                    client = ClientConfig(base_url=end.base_url, api_key=end.api_key or "EMPTY", model=end.model)
                    return await run_agent_at(env, job.task, client, trajectory_id=tid)
                if isinstance(self.engine, InferenceEngine):
                    assert self.tok is not None  # checked in __init__
                    return await EpisodeRunner(self.engine, self.tok, self._sampling(job), self.plan.budget).run(
                        env, job.task, env_name=self.plan.env_name, group_id=f"{self.id_prefix}{job.item_index}",
                        trajectory_id=tid)
                return await ChatEpisodeRunner(self.engine, self._sampling(job), self.plan.budget).run(
                    env, job.task, env_name=self.plan.env_name, trajectory_id=tid)

    async def sample(self, job: _Job) -> SampleRecord:
        t0 = time.monotonic()
        error = ""
        attempts = 0
        for attempts in range(1, self.plan.sample_retries + 2):
            try:
                episode = await self._episode(job)
            except (InfrastructureError, TimeoutError) as exc:
                error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                logger.warning("eval sample %s:%s attempt %d failed: %s", job.item_index, job.sample_index,
                               attempts, error)
                continue
            if isinstance(episode, DirectEpisode):
                return to_agent_record(job, episode, threshold=self.plan.correct_threshold, attempts=attempts,
                                       duration_s=time.monotonic() - t0)
            if isinstance(episode, ChatEpisode):
                return to_chat_record(job, episode, threshold=self.plan.correct_threshold, attempts=attempts,
                                      duration_s=time.monotonic() - t0, keep_transcript=self.plan.keep_trajectories)
            return to_record(job, episode, threshold=self.plan.correct_threshold, attempts=attempts,
                             duration_s=time.monotonic() - t0, keep_trajectory=self.plan.keep_trajectories)
        return SampleRecord(item_index=job.item_index, sample_index=job.sample_index, task_id=job.task.id,
                            status="error", error=error[:2000], attempts=attempts, prompt=job.task.prompt,
                            answer=job.task.answer, duration_s=round(time.monotonic() - t0, 4),
                            token_level=not self.chat)

    async def one(self, job: _Job) -> None:
        """Run one admitted job (its slot of ``self.local`` is released here)."""
        try:
            if self.limiter is not None:
                async with self.limiter:
                    record = await self.sample(job)
            else:
                record = await self.sample(job)
        finally:
            self.local.release()
        self.failed_in_a_row = 0 if record.ok else self.failed_in_a_row + 1
        if self.on_record is not None:
            await self.on_record(record)
        self.records.append(record if self.keep_records else record.without_trajectory())
        limit = self.plan.max_consecutive_errors
        if limit is not None and self.failed_in_a_row >= limit:
            raise TooManyErrors(f"{self.failed_in_a_row} samples failed in a row; the last error: {record.error}")

    async def all(self, jobs: Sequence[_Job]) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                for job in jobs:
                    await self.local.acquire()  # one task per free slot: no thousands of waiting tasks
                    tg.create_task(self.one(job))
        except ExceptionGroup as eg:  # the first failure, as itself (TooManyErrors, a callback's error, ...)
            first: BaseException = eg
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from None


async def run_eval(spec: EvalSpec, *, engine: InferenceEngine | ChatEngine, tokenizer: ChatTokenizer | None,
                   resources: EnvResources,
                   tasks: Sequence[Task] | None = None, completed: Iterable[SampleRecord] = (),
                   on_record: RecordCallback | None = None, cancel: asyncio.Event | None = None,
                   limiter: asyncio.Semaphore | None = None, registry: Registry = default_registry,
                   keep_records: bool = True, id_prefix: str = "eval-") -> EvalResult:
    """Run ``spec`` and return its metrics and records: its environment is checked, its dataset loaded unless
    ``tasks`` holds it already (any path allowed), then :func:`run_plan` runs it (see there for the rest).
    Raises ConfigError for a bad spec."""
    await check_environment(spec, resources, registry)
    tasks = list(tasks) if tasks is not None else load_tasks(spec.dataset)
    return await run_plan(EvalPlan.of(spec), tasks, engine=engine, tokenizer=tokenizer, resources=resources,
                          completed=completed, on_record=on_record, cancel=cancel, limiter=limiter,
                          registry=registry, keep_records=keep_records, id_prefix=id_prefix)


async def run_plan(plan: EvalPlan, tasks: Sequence[Task], *, engine: InferenceEngine | ChatEngine,
                   tokenizer: ChatTokenizer | None, resources: EnvResources, completed: Iterable[SampleRecord] = (),
                   on_record: RecordCallback | None = None, cancel: asyncio.Event | None = None,
                   limiter: asyncio.Semaphore | None = None, registry: Registry = default_registry,
                   keep_records: bool = True, id_prefix: str = "eval-") -> EvalResult:
    """Run ``plan.samples_per_item`` episodes of each task and return the metrics and records.

    ``completed``: records of samples already run (resumption: they are skipped and counted);
    ``on_record``: awaited with each new record as it finishes; ``cancel``: when set, running episodes are
    cancelled and the result (status ``cancelled``) holds the records so far; ``limiter``: a semaphore shared
    with other evaluations (a global episode limit); ``keep_records``: False drops trajectories from the
    returned records (they were handed to ``on_record`` already).

    A sample's infrastructure failure (an :class:`InfrastructureError`: engine, sandbox, or a reward that could
    not be computed; or its episode timing out) is retried ``sample_retries`` times, then recorded as an error
    sample, which no metric scores. Raises :class:`TooManyErrors` when ``max_consecutive_errors`` samples fail
    in a row."""
    t0 = time.monotonic()
    done = {r.key: r for r in completed}
    run = _Run(plan, engine, tokenizer, resources, registry, on_record, limiter, id_prefix, keep_records)
    jobs = [_Job(i, s, task) for i, task in enumerate(tasks) for s in range(plan.samples_per_item)
            if f"{i}:{s}" not in done]
    finished = False
    async with contextlib.AsyncExitStack() as stack:
        if run.agent and isinstance(engine, InferenceEngine) and jobs:
            assert tokenizer is not None  # checked by _Run
            # one branch per sample: the one the agent ended on, every token it sampled there
            run.agents = await stack.enter_async_context(served_agents(
                engine, tokenizer, plan.sampling, replace(plan.budget, max_branches=1),
                tool_parser=str(plan.env_options.get("tool_parser", BUILTIN))))
        work = asyncio.ensure_future(run.all(jobs))
        waiters = {work} | ({asyncio.ensure_future(cancel.wait())} if cancel is not None else set())
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finished = work.done()
        finally:
            for t in waiters:
                t.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
    if finished:
        work.result()  # re-raise its error
    cancelled = not finished
    records = [*done.values(), *run.records]
    # in a thread: bootstrap intervals over thousands of items take about a second
    metrics = await asyncio.to_thread(compute_metrics, records, plan.pass_k, item_groups(tasks, plan.group_by))
    return EvalResult(status="cancelled" if cancelled else "succeeded", metrics=metrics, records=tuple(records),
                      total=len(tasks) * plan.samples_per_item, wall_time_s=round(time.monotonic() - t0, 3))


async def _endpoint(engine: InferenceEngine | ChatEngine) -> ChatEndpoint:
    endpoint = getattr(engine, "endpoint", None)
    if endpoint is None:
        raise ConfigError(f"an agent environment needs its model's address; {type(engine).__name__} has none (an "
                          "openai_url model's chat client or a served model)")
    return await endpoint()  # type: ignore[no-any-return]
