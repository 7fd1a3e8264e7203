"""Metrics of an evaluation, computed from its sample records (definitions in :mod:`agentrl.eval.base`).

Every metric is over ok samples (errors are counted, never scored). Keys:

- ``num_items`` (items with at least one ok sample), ``num_samples`` (ok), ``num_errors``;
- ``mean_reward``, ``accuracy`` (fraction of ok samples that are correct);
- ``pass@k`` for each requested k: the unbiased estimator averaged over items with >= k ok samples
  (``pass@1`` is then the mean per-item accuracy);
- ``mean_turns``, ``mean_tool_calls`` (per episode), ``tool_calls``, ``tool_errors``,
  ``tool_error_rate`` = tool_errors / tool_calls (a tool error: malformed call, or a result that is not ok);
- ``mean_prompt_tokens``, ``mean_response_tokens`` (after the prompt), ``mean_model_tokens`` (generated),
  ``total_tokens``, ``total_model_tokens``;
- ``finish_reasons``: episodes per finish reason;
- ``token_level``: False when any sample ran through chat completions (an ``openai_url`` model: token counts are
  the server's ``usage``, and no record holds token ids, logprobs or weight versions); None before any sample.

A metric with nothing to average over is None.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from agentrl.eval.base import SampleRecord


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one item with ``n`` samples, ``c`` correct: ``1 - C(n-c, k) / C(n, k)``.

    Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k / i)`` (the product form of the same ratio: no huge
    binomials). Raises ValueError unless ``0 <= c <= n`` and ``1 <= k <= n``."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def compute_metrics(records: Iterable[SampleRecord], pass_k: Sequence[int]) -> dict[str, Any]:
    """The metrics of an evaluation (see the module docstring) from its records, in any order."""
    all_records = list(records)
    ok = [r for r in all_records if r.ok]
    per_item: dict[int, list[bool]] = defaultdict(list)
    for r in ok:
        per_item[r.item_index].append(bool(r.correct))
    tool_calls = sum(r.num_tool_calls for r in ok)
    tool_errors = sum(r.num_tool_errors for r in ok)
    metrics: dict[str, Any] = {
        "num_items": len(per_item),
        "num_samples": len(ok),
        "num_errors": len(all_records) - len(ok),
        "mean_reward": _mean([float(r.reward or 0.0) for r in ok]),
        "accuracy": _mean([1.0 if r.correct else 0.0 for r in ok]),
    }
    for k in sorted(set(pass_k)):
        scores = [pass_at_k(len(v), sum(v), k) for v in per_item.values() if len(v) >= k]
        metrics[f"pass@{k}"] = _mean(scores)
    metrics.update({
        "mean_turns": _mean([float(r.num_turns) for r in ok]),
        "mean_tool_calls": _mean([float(r.num_tool_calls) for r in ok]),
        "tool_calls": tool_calls,
        "tool_errors": tool_errors,
        "tool_error_rate": tool_errors / tool_calls if tool_calls else None,
        "mean_prompt_tokens": _mean([float(r.prompt_tokens) for r in ok]),
        "mean_response_tokens": _mean([float(r.response_tokens) for r in ok]),
        "mean_model_tokens": _mean([float(r.model_tokens) for r in ok]),
        "total_tokens": sum(r.prompt_tokens + r.response_tokens for r in ok),
        "total_model_tokens": sum(r.model_tokens for r in ok),
        "finish_reasons": dict(sorted(Counter(str(r.finish_reason) for r in ok).items())),
        "token_level": all(r.token_level for r in all_records) if all_records else None,
    })
    return metrics
