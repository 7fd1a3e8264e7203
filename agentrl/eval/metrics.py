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
  the server's ``usage``, and no record holds token ids, logprobs or weight versions); None before any sample;
- ``intervals``: for ``mean_reward``, ``accuracy`` and each ``pass@k``, its :class:`agentrl.eval.stats.Interval`
  (``estimate``, ``stderr``, ``low``, ``high``, ``method``, ``n`` items, ``level`` 0.95) over items — exact
  Clopper–Pearson for binary outcomes, else a seeded bootstrap over items (see :mod:`agentrl.eval.stats`); None
  for a metric that is None;
- ``groups`` (only when the items are grouped: ``group_by``): per group value, ``num_items``, ``num_samples``,
  ``mean_reward``, ``accuracy``, each ``pass@k`` and their ``intervals``.

A metric with nothing to average over is None.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agentrl.data.loader import get_key, has_key
from agentrl.eval.base import SampleRecord
from agentrl.eval.stats import item_interval
from agentrl.types import Task


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


def _scored(ok: Sequence[SampleRecord], pass_k: Sequence[int]) -> dict[str, Any]:
    """``mean_reward``, ``accuracy``, ``pass@k`` and their ``intervals`` over the items of ``ok`` samples."""
    items: dict[int, list[SampleRecord]] = defaultdict(list)
    for r in ok:
        items[r.item_index].append(r)
    groups = list(items.values())
    counts = [len(g) for g in groups]
    rewards = [[float(r.reward or 0.0) for r in g] for g in groups]
    correct = [sum(1 for r in g if r.correct) for g in groups]
    one_each = all(n == 1 for n in counts)
    out: dict[str, Any] = {
        "mean_reward": _mean([x for g in rewards for x in g]),
        "accuracy": _mean([1.0 if r.correct else 0.0 for r in ok]),
    }
    intervals: dict[str, Any] = {
        "mean_reward": item_interval([sum(g) for g in rewards], counts,
                                     binary=one_each and all(g[0] in (0.0, 1.0) for g in rewards)),
        "accuracy": item_interval(correct, counts, binary=one_each),
    }
    for k in sorted(set(pass_k)):
        kept = [(n, c) for n, c in zip(counts, correct) if n >= k]
        scores = [pass_at_k(n, c, k) for n, c in kept]
        out[f"pass@{k}"] = _mean(scores)
        intervals[f"pass@{k}"] = item_interval(scores, [1.0] * len(scores), binary=all(n == k for n, _ in kept))
    out["intervals"] = {name: iv.to_dict() if iv is not None else None for name, iv in intervals.items()}
    return out


def compute_metrics(records: Iterable[SampleRecord], pass_k: Sequence[int],
                    groups: Mapping[int, str] | None = None) -> dict[str, Any]:
    """The metrics of an evaluation (see the module docstring) from its records, in any order. ``groups``: the
    group of each item index (items missing from it are in no group); adds ``groups`` to the metrics."""
    all_records = list(records)
    ok = [r for r in all_records if r.ok]
    per_item: dict[int, list[bool]] = defaultdict(list)
    for r in ok:
        per_item[r.item_index].append(bool(r.correct))
    tool_calls = sum(r.num_tool_calls for r in ok)
    tool_errors = sum(r.num_tool_errors for r in ok)
    scored = _scored(ok, pass_k)
    intervals = scored.pop("intervals")
    metrics: dict[str, Any] = {
        "num_items": len(per_item),
        "num_samples": len(ok),
        "num_errors": len(all_records) - len(ok),
        **scored,
    }
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
        "intervals": intervals,
    })
    if groups is not None:
        metrics["groups"] = _by_group(ok, pass_k, groups)
    return metrics


def item_groups(tasks: Sequence[Task], key: str | None) -> dict[int, str] | None:
    """The group of each item: its metadata value under ``key`` (a dotted path reaches into nested values) as a
    string; items without it are in no group. None when ``key`` is None (no grouping)."""
    if key is None:
        return None
    out: dict[int, str] = {}
    for i, task in enumerate(tasks):
        if has_key(task.metadata, key):
            value = get_key(task.metadata, key)
            if isinstance(value, str | int | float | bool):
                out[i] = str(value)
    return out


def _by_group(ok: Sequence[SampleRecord], pass_k: Sequence[int], groups: Mapping[int, str]) -> dict[str, Any]:
    members: dict[str, list[SampleRecord]] = defaultdict(list)
    for r in ok:
        if r.item_index in groups:
            members[groups[r.item_index]].append(r)
    return {name: {"num_items": len({r.item_index for r in rs}), "num_samples": len(rs), **_scored(rs, pass_k)}
            for name, rs in sorted(members.items())}


def item_scores(records: Iterable[SampleRecord], metric: str) -> tuple[dict[str, float], bool]:
    """Each item's score under ``metric`` (``accuracy``, ``mean_reward`` or ``pass@K``) over its ok samples, keyed
    by the item's id (its index when ids repeat), and whether every score is a 0/1 outcome by construction (one
    sample per item, or K = the item's samples; for ``mean_reward``: also 0/1 rewards). The key is the item's id
    and a hash of its prompt (its index instead of the id when ids repeat), so two runs pair only on the same
    items. Items without ok samples (or with fewer than K) are left out. Raises ValueError for an unknown metric."""
    k = None
    if metric.startswith("pass@"):
        try:
            k = int(metric[5:])
        except ValueError:
            raise ValueError(f"unknown metric {metric!r}: expected accuracy, mean_reward or pass@K") from None
        if k < 1:
            raise ValueError(f"pass@K needs K >= 1, got {metric!r}")
    elif metric not in ("accuracy", "mean_reward"):
        raise ValueError(f"unknown metric {metric!r}: expected accuracy, mean_reward or pass@K")
    by_index: dict[int, list[SampleRecord]] = defaultdict(list)
    for r in records:
        if r.ok:
            by_index[r.item_index].append(r)
    ids = {i: rs[0].task_id for i, rs in by_index.items()}
    unique = len(set(ids.values())) == len(ids)

    def key(i: int) -> str:
        digest = hashlib.sha256(by_index[i][0].prompt.encode()).hexdigest()[:16]
        return f"{ids[i] if unique else i}#{digest}"

    scores: dict[str, float] = {}
    binary = True
    for i, rs in by_index.items():
        n, c = len(rs), sum(1 for r in rs if r.correct)
        if k is not None:
            if n < k:
                continue
            score, is_binary = pass_at_k(n, c, k), n == k
        elif metric == "accuracy":
            score, is_binary = c / n, n == 1
        else:
            score = sum(float(r.reward or 0.0) for r in rs) / n
            is_binary = n == 1 and score in (0.0, 1.0)
        scores[key(i)] = score
        binary = binary and is_binary
    return scores, binary
