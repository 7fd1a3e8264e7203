"""Metrics: the unbiased pass@k estimator against brute-force enumeration, and the metric table of records."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentrl.eval import SampleRecord, compute_metrics, pass_at_k


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of the k-subsets of n samples (c correct) holding at least one correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@given(st.integers(1, 9).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_is_the_probability_that_k_draws_hold_a_correct_one(nck: tuple[int, int, int]) -> None:
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_edges_and_bad_input() -> None:
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100))
    for bad in ((3, 4, 1), (3, 1, 0), (3, 1, 4), (3, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def rec(item: int, sample: int, correct: bool, **kw: object) -> SampleRecord:
    base: dict[str, object] = {
        "item_index": item, "sample_index": sample, "task_id": f"t{item}", "status": "ok",
        "reward": 1.0 if correct else 0.0, "correct": correct, "finish_reason": "stop", "num_turns": 2,
        "num_tool_calls": 1, "num_tool_errors": 0, "prompt_tokens": 10, "response_tokens": 5, "model_tokens": 4}
    base.update(kw)
    return SampleRecord(**base)  # type: ignore[arg-type]


def test_metrics_table() -> None:
    records = [
        rec(0, 0, True), rec(0, 1, False), rec(0, 2, False), rec(0, 3, False),  # item 0: 1 of 4
        rec(1, 0, False, num_tool_calls=3, num_tool_errors=2, finish_reason="length"),
        rec(1, 1, False), rec(1, 2, False), rec(1, 3, False),  # item 1: 0 of 4
        SampleRecord(item_index=2, sample_index=0, task_id="t2", status="error", error="engine down"),
    ]
    m = compute_metrics(records, [1, 4])
    assert (m["num_items"], m["num_samples"], m["num_errors"]) == (2, 8, 1)
    assert m["mean_reward"] == pytest.approx(1 / 8) and m["accuracy"] == pytest.approx(1 / 8)
    assert m["pass@1"] == pytest.approx((0.25 + 0.0) / 2)
    assert m["pass@4"] == pytest.approx((1.0 + 0.0) / 2)
    assert (m["tool_calls"], m["tool_errors"]) == (10, 2) and m["tool_error_rate"] == pytest.approx(0.2)
    assert m["mean_tool_calls"] == pytest.approx(10 / 8) and m["mean_turns"] == 2.0
    assert (m["total_tokens"], m["total_model_tokens"]) == (8 * 15, 8 * 4)
    assert m["finish_reasons"] == {"length": 1, "stop": 7}


def test_items_with_fewer_than_k_ok_samples_are_left_out_of_pass_at_k() -> None:
    records = [rec(0, 0, True), rec(0, 1, False), rec(1, 0, True)]
    m = compute_metrics(records, [1, 2])
    assert m["pass@2"] == 1.0  # only item 0 has 2 samples
    assert m["pass@1"] == pytest.approx((0.5 + 1.0) / 2)


def test_no_samples_gives_none_not_zero() -> None:
    m = compute_metrics([], [1])
    assert m["mean_reward"] is None and m["pass@1"] is None and m["tool_error_rate"] is None
    assert m["num_samples"] == 0
