"""Run an evaluation: ``samples_per_item`` episodes per item, bounded concurrency, metrics over the records.

:func:`run_eval` takes everything it needs as arguments (engine, tokenizer, environment resources), so it runs
inside the REST service, a CLI, or a training script alike. It resumes: samples given in ``completed`` are not
run again and count in the metrics. It stops early, with the records so far, when ``cancel`` is set.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from agentrl.async_rollout.episode import EpisodeBudget, EpisodeRunner
from agentrl.engine.base import InferenceEngine, SamplingParams
from agentrl.env.registry import EnvResources, Registry, default_registry
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
from agentrl.eval.metrics import compute_metrics
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
class _Job:
    item_index: int
    sample_index: int
    task: Task


def to_record(job: _Job, traj: Trajectory, *, threshold: float, attempts: int, duration_s: float,
              keep_trajectory: bool) -> SampleRecord:
    calls = [c for t in traj.turns for c in t.tool_calls]
    results = [r for t in traj.turns for r in t.tool_results]
    bad = sum(1 for c in calls if c.error is not None) + sum(1 for r in results if not r.ok and r.status != "malformed")
    breakdown = {k: v for k, v in traj.reward_breakdown.items() if finite(v) is not None}
    return SampleRecord(
        item_index=job.item_index, sample_index=job.sample_index, task_id=job.task.id, status="ok",
        reward=finite(traj.reward), correct=is_correct(traj.reward, breakdown, threshold),
        reward_breakdown=breakdown, finish_reason=traj.finish_reason.value, num_turns=len(traj.turns),
        num_tool_calls=len(calls), num_tool_errors=bad, prompt_tokens=traj.prompt_len,
        response_tokens=traj.num_tokens - traj.prompt_len, model_tokens=traj.num_model_tokens,
        duration_s=round(duration_s, 4), attempts=attempts, prompt=job.task.prompt, answer=job.task.answer,
        response=RewardInput.from_turns(traj.turns).text,
        trajectory=_finite_trajectory(traj) if keep_trajectory else None,
    )


def _finite_trajectory(traj: Trajectory) -> dict[str, object]:
    """``Trajectory.to_dict()`` for JSON readers: turns as objects with named fields, NaN/inf as null."""
    d = traj.to_dict()
    d["behavior_logprobs"] = [finite(x) for x in d["behavior_logprobs"]]
    d["reward"] = finite(traj.reward)
    d["reward_breakdown"] = {k: finite(v) for k, v in traj.reward_breakdown.items()}
    d["turns"] = [t.as_dict() for t in traj.turns]
    return d


class _Run:
    """The state of one :func:`run_eval` call."""

    def __init__(self, spec: EvalSpec, engine: InferenceEngine, tokenizer: ChatTokenizer, resources: EnvResources,
                 registry: Registry, on_record: RecordCallback | None, limiter: asyncio.Semaphore | None,
                 id_prefix: str, keep_records: bool) -> None:
        self.spec, self.engine, self.tok, self.resources, self.registry = spec, engine, tokenizer, resources, registry
        self.on_record, self.limiter, self.id_prefix = on_record, limiter, id_prefix
        self.keep_records = keep_records  # False: trajectories are not held in memory (on_record has them)
        self.records: list[SampleRecord] = []
        self.failed_in_a_row = 0
        self.local = asyncio.Semaphore(spec.max_concurrency)

    def _runner(self, job: _Job) -> EpisodeRunner:
        s, sp = self.spec, self.spec.sampling
        seed = None if sp.seed is None else sp.seed + job.item_index * s.samples_per_item + job.sample_index
        sampling = SamplingParams(max_new_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p,
                                  top_k=sp.top_k, stop=tuple(sp.stop), seed=seed)
        budget = EpisodeBudget(max_turns=s.max_turns, max_response_tokens=s.max_response_tokens,
                               max_context_tokens=s.max_context_tokens)
        return EpisodeRunner(self.engine, self.tok, sampling, budget)

    async def _episode(self, job: _Job) -> Trajectory:
        env = self.registry.make_env(self.spec.environment.name, self.resources, **self.spec.environment.options)
        tid = f"{self.id_prefix}{job.item_index}-{job.sample_index}"
        async with env:
            async with asyncio.timeout(self.spec.episode_timeout_s):
                return await self._runner(job).run(env, job.task, env_name=self.spec.environment.name,
                                                   group_id=f"{self.id_prefix}{job.item_index}", trajectory_id=tid)

    async def sample(self, job: _Job) -> SampleRecord:
        t0 = time.monotonic()
        error = ""
        attempts = 0
        for attempts in range(1, self.spec.sample_retries + 2):
            try:
                traj = await self._episode(job)
            except (InfrastructureError, TimeoutError) as exc:
                error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                logger.warning("eval sample %s:%s attempt %d failed: %s", job.item_index, job.sample_index,
                               attempts, error)
                continue
            return to_record(job, traj, threshold=self.spec.correct_threshold, attempts=attempts,
                             duration_s=time.monotonic() - t0, keep_trajectory=self.spec.keep_trajectories)
        return SampleRecord(item_index=job.item_index, sample_index=job.sample_index, task_id=job.task.id,
                            status="error", error=error[:2000], attempts=attempts, prompt=job.task.prompt,
                            answer=job.task.answer, duration_s=round(time.monotonic() - t0, 4))

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
        if self.failed_in_a_row >= self.spec.max_consecutive_errors:
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


async def run_eval(spec: EvalSpec, *, engine: InferenceEngine, tokenizer: ChatTokenizer, resources: EnvResources,
                   tasks: Sequence[Task] | None = None, completed: Iterable[SampleRecord] = (),
                   on_record: RecordCallback | None = None, cancel: asyncio.Event | None = None,
                   limiter: asyncio.Semaphore | None = None, registry: Registry = default_registry,
                   keep_records: bool = True, id_prefix: str = "eval-") -> EvalResult:
    """Run ``spec`` and return its metrics and records.

    ``tasks``: the dataset already loaded (else loaded from ``spec.dataset``, any path allowed);
    ``completed``: records of samples already run (resumption: they are skipped and counted);
    ``on_record``: awaited with each new record as it finishes; ``cancel``: when set, running episodes are
    cancelled and the result (status ``cancelled``) holds the records so far; ``limiter``: a semaphore shared
    with other evaluations (a global episode limit); ``keep_records``: False drops trajectories from the
    returned records (they were handed to ``on_record`` already).

    Raises ConfigError for a bad spec and :class:`TooManyErrors` when ``max_consecutive_errors`` samples fail in
    a row; a single sample's infrastructure failure is retried, then recorded as an error sample."""
    t0 = time.monotonic()
    await check_environment(spec, resources, registry)
    tasks = list(tasks) if tasks is not None else load_tasks(spec.dataset)
    done = {r.key: r for r in completed}
    run = _Run(spec, engine, tokenizer, resources, registry, on_record, limiter, id_prefix, keep_records)
    jobs = [_Job(i, s, task) for i, task in enumerate(tasks) for s in range(spec.samples_per_item)
            if f"{i}:{s}" not in done]
    work = asyncio.ensure_future(run.all(jobs))
    waiters = {work} | ({asyncio.ensure_future(cancel.wait())} if cancel is not None else set())
    finished = False
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
    metrics = compute_metrics(records, spec.pass_k)
    return EvalResult(status="cancelled" if cancelled else "succeeded", metrics=metrics, records=tuple(records),
                      total=len(tasks) * spec.samples_per_item, wall_time_s=round(time.monotonic() - t0, 3))
