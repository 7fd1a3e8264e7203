"""Evaluations: ``samples_per_item`` episodes per dataset item, with mean reward, unbiased pass@k, turn and
tool-call statistics, and per-sample records (usable from Python, the CLI and the REST service).

    from agentrl.eval import EvalSpec, run_eval
    result = await run_eval(spec, engine=engine, tokenizer=tok, resources=resources)   # your own engine
    result = await evaluate(spec)                        # or: start what it needs (sandbox, SGLang server)

A spec's ``model.openai_url`` evaluates a model agentrl does not serve, through any OpenAI-compatible chat
completions server (text level: records and metrics say ``token_level: false``).

The one evaluator: a training run's held-out evaluation runs here too (:func:`run_plan`).
"""

from agentrl.eval.base import EvalResult, RecordCallback, SampleRecord, SpecError, UnknownEnvironmentError
from agentrl.eval.datasets import DatasetFactory, builtin_datasets, load_tasks
from agentrl.eval.engines import (
    EngineLease,
    LimitedChatEngine,
    LimitedEngine,
    ModelServers,
    ResolvedModel,
    resolve_model_spec,
)
from agentrl.eval.metrics import compute_metrics, item_scores, pass_at_k
from agentrl.eval.runner import EvalPlan, TooManyErrors, check_environment, run_eval, run_plan
from agentrl.eval.services import EvalServices, evaluate
from agentrl.eval.spec import DatasetItem, DatasetSpec, EnvironmentSpec, EvalSpec, ModelSpec, SamplingSpec
from agentrl.eval.stats import Interval, PairedComparison, clopper_pearson, compare_paired, item_interval
from agentrl.rewards.base import CORRECT_KEY, correctness_score, is_correct

__all__ = [
    "CORRECT_KEY", "DatasetFactory", "DatasetItem", "DatasetSpec", "EngineLease", "EnvironmentSpec", "EvalPlan",
    "EvalResult", "EvalServices", "EvalSpec", "Interval", "PairedComparison", "LimitedChatEngine", "LimitedEngine", "ModelServers", "ModelSpec", "RecordCallback",
    "ResolvedModel", "SampleRecord", "SamplingSpec", "SpecError", "TooManyErrors", "UnknownEnvironmentError",
    "builtin_datasets", "check_environment", "clopper_pearson", "compare_paired", "compute_metrics", "correctness_score", "evaluate", "is_correct",
    "item_interval", "item_scores", "load_tasks", "pass_at_k", "resolve_model_spec", "run_eval", "run_plan",
]
