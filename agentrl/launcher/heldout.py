"""A training run's held-out evaluation, run by :mod:`agentrl.eval` (the evaluator of the REST service and
``agentrl eval``): one greedy episode per held-out task on the rollout's own engine, sandbox and checker.

The run's files keep their meaning:

- ``eval_<label>.jsonl``: one line per task, in task order: ``task_id``, ``prompt``, ``answer`` and either
  ``correct``, ``reward``, ``finish_reason``, ``turns`` (the model's text per turn), ``tools`` (tool outputs per
  turn), or ``error`` (the infrastructure failure that left the task unscored);
- the figures returned (``evals.json``, the summary and the report read them): ``n`` (scored episodes),
  ``accuracy`` and ``reward_mean``, ``turns_mean``, ``tool_calls_mean`` over them, ``errors`` (unscored ones).

An infrastructure failure is not retried and never stops the run: it is counted in ``errors`` and left out of
every mean (0.0 when nothing was scored).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from agentrl.engine.base import InferenceEngine
from agentrl.env.registry import EnvResources
from agentrl.eval import EvalPlan, SampleRecord, run_plan
from agentrl.launcher.config import RunConfig
from agentrl.tokenizer import ChatTokenizer
from agentrl.types import Task


def heldout_plan(cfg: RunConfig) -> EvalPlan:
    """Greedy sampling within the rollout's budgets, ``max_running_groups`` episodes at once."""
    r = cfg.rollout
    return EvalPlan(
        env_name=cfg.env.name, env_options=dict(cfg.env.options),
        sampling=replace(r.sampling, temperature=0.0), budget=r.budget,
        max_concurrency=r.scheduler.max_running_groups, sample_retries=0, max_consecutive_errors=None,
        episode_timeout_s=None, keep_trajectories=True)


async def heldout_eval(cfg: RunConfig, tasks: Sequence[Task], *, engine: InferenceEngine, tokenizer: ChatTokenizer,
                       resources: EnvResources) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Evaluate ``tasks``; returns the figures and the records, one per task in task order (see the module
    docstring). The caller writes the records (:func:`write_records`): on Ray the rollout side returns them to
    the controller, which owns ``eval_<label>.jsonl`` (the rollout's node may share no directory with it)."""
    result = await run_plan(heldout_plan(cfg), tasks, engine=engine, tokenizer=tokenizer, resources=resources,
                            id_prefix="heldout-")
    records = [_line(r) for r in sorted(result.records, key=lambda r: r.item_index)]
    m = result.metrics
    figures = {"n": m["num_samples"], "accuracy": m["accuracy"] or 0.0, "reward_mean": m["mean_reward"] or 0.0,
               "turns_mean": m["mean_turns"] or 0.0, "tool_calls_mean": m["mean_tool_calls"] or 0.0,
               "errors": m["num_errors"]}
    return figures, records


def write_records(path: Path, records: Sequence[dict[str, Any]]) -> None:
    """``eval_<label>.jsonl``: one JSON line per record."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _line(r: SampleRecord) -> dict[str, Any]:
    line: dict[str, Any] = {"task_id": r.task_id, "prompt": r.prompt, "answer": r.answer}
    if not r.ok:
        return line | {"error": r.error}
    turns = r.trajectory["turns"] if r.trajectory is not None else []
    return line | {"correct": r.correct, "reward": r.reward, "finish_reason": r.finish_reason,
                   "turns": [t["text"] for t in turns],
                   "tools": [[x["output"] for x in t["tool_results"]] for t in turns]}
