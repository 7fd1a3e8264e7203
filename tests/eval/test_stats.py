"""Intervals and paired tests of evaluation metrics, against direct computations: the Clopper–Pearson bound from the
binomial distribution itself and published values, the bootstrap against a plain numpy bootstrap, McNemar's test
and the permutation test against enumeration."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from agentrl.eval import SampleRecord, clopper_pearson, compare_paired, compute_metrics, item_interval, item_scores


def binom_cdf(x: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(x + 1))


@pytest.mark.parametrize(("x", "n"), [(0, 10), (1, 10), (5, 10), (9, 10), (10, 10), (17, 40), (3, 200)])
def test_clopper_pearson_bounds_solve_the_binomial_tail_equations(x: int, n: int) -> None:
    low, high = clopper_pearson(x, n)
    # the exact interval: P(X >= x; low) = 0.025 and P(X <= x; high) = 0.025 (a bound is 0 or 1 at the edges)
    if x == 0:
        assert low == 0.0
    else:
        assert 1 - binom_cdf(x - 1, n, low) == pytest.approx(0.025, abs=1e-9)
    if x == n:
        assert high == 1.0
    else:
        assert binom_cdf(x, n, high) == pytest.approx(0.025, abs=1e-9)


def test_clopper_pearson_published_values() -> None:
    # Clopper & Pearson (1934) style tables, e.g. as reproduced by NIST and R's binom.test
    assert clopper_pearson(0, 10) == pytest.approx((0.0, 0.3084971), abs=1e-6)
    assert clopper_pearson(5, 10) == pytest.approx((0.1870860, 0.8129140), abs=1e-6)
    assert clopper_pearson(1, 10) == pytest.approx((0.002528579, 0.4450161), abs=1e-6)
    for bad in ((3, 2), (-1, 4), (0, 0)):
        with pytest.raises(ValueError):
            clopper_pearson(*bad)


def test_binary_items_get_the_exact_interval_and_the_binomial_stderr() -> None:
    outcomes = [1] * 25 + [0] * 15
    iv = item_interval(outcomes, [1] * 40, binary=True)
    assert iv is not None and iv.method == "clopper-pearson" and iv.n == 40
    assert iv.estimate == 0.625 and iv.stderr == pytest.approx(math.sqrt(0.625 * 0.375 / 40))
    assert (iv.low, iv.high) == pytest.approx(clopper_pearson(25, 40))
    with pytest.raises(ValueError):
        item_interval([2, 0], [1, 1], binary=True)


def numpy_bootstrap(sums: np.ndarray, counts: np.ndarray, resamples: int, seed: int) -> tuple[float, float, float]:
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(sums), size=(resamples, len(sums)))
    est = sums[idx].sum(axis=1) / counts[idx].sum(axis=1)
    return float(np.percentile(est, 2.5)), float(np.percentile(est, 97.5)), float(est.std(ddof=1))


def test_the_bootstrap_over_items_matches_a_direct_bootstrap() -> None:
    rng = np.random.default_rng(7)
    counts = rng.integers(1, 6, size=60).astype(float)  # 1..5 ok samples per item
    sums = np.array([rng.binomial(int(n), p) for n, p in zip(counts, rng.uniform(0, 1, 60))], dtype=float)
    iv = item_interval(sums, counts, binary=False)
    assert iv is not None and iv.method == "bootstrap" and iv.n == 60
    assert iv.estimate == pytest.approx(sums.sum() / counts.sum())
    low, high, se = numpy_bootstrap(sums, counts, 40_000, seed=123)  # another stream, many more draws
    assert iv.low == pytest.approx(low, abs=0.012) and iv.high == pytest.approx(high, abs=0.012)
    assert iv.stderr == pytest.approx(se, rel=0.06)
    assert iv.low < iv.estimate < iv.high
    assert item_interval(sums, counts, binary=False) == iv  # a fixed seed: the same records, the same interval
    assert item_interval(sums, counts, binary=False, seed=1) != iv


def test_degenerate_inputs() -> None:
    assert item_interval([], [], binary=False) is None
    one = item_interval([0.5], [1], binary=False)
    assert one is not None and one.low is None and one.stderr is None
    same = item_interval([1.0, 1.0, 1.0], [2, 2, 2], binary=False)
    assert same is not None and same.low == same.high == same.estimate == 0.5


def test_mcnemar_exact_against_the_binomial() -> None:
    # 10 discordant items: 8 where b is right and a wrong, 2 the other way; 20 concordant
    a = [0] * 8 + [1] * 2 + [1] * 12 + [0] * 8
    b = [1] * 8 + [0] * 2 + [1] * 12 + [0] * 8
    c = compare_paired(a, b, binary=True)
    assert c.test == "mcnemar-exact" and c.discordant == (8, 2) and c.n == 30
    assert c.p_value == pytest.approx(2 * sum(math.comb(10, i) for i in range(3)) / 2**10)
    assert c.difference == pytest.approx(6 / 30) and c.low is not None and c.high is not None
    assert c.low <= c.difference <= c.high
    d = np.array(b, float) - np.array(a, float)
    assert c.stderr == pytest.approx(d.std(ddof=1) / math.sqrt(30))
    assert compare_paired(a, a, binary=True).p_value == 1.0


def test_the_permutation_test_matches_enumeration() -> None:
    a = [0.2, 0.5, 0.25, 0.75, 0.4, 0.1, 0.6]
    b = [0.6, 0.5, 0.75, 1.0, 0.2, 0.5, 0.9]
    c = compare_paired(a, b, binary=False)
    d = np.array(b) - np.array(a)
    t = d.mean()
    flips = [np.mean(d * np.array(s)) for s in itertools.product((1, -1), repeat=len(d))]
    less = sum(f <= t + 1e-12 for f in flips) / len(flips)
    greater = sum(f >= t - 1e-12 for f in flips) / len(flips)
    assert c.test == "paired-permutation"
    assert c.p_value == pytest.approx(min(1.0, 2 * min(less, greater)))
    assert c.difference == pytest.approx(t) and c.mean_b - c.mean_a == pytest.approx(t)
    with pytest.raises(ValueError):
        compare_paired([], [], binary=False)


def rec(item: int, sample: int, correct: bool, **kw: object) -> SampleRecord:
    return SampleRecord(item_index=item, sample_index=sample, task_id=f"t{item}", status="ok",  # type: ignore[arg-type]
                        reward=1.0 if correct else 0.0, correct=correct, **kw)


def test_metrics_carry_intervals_overall_and_per_group() -> None:
    one_each = [rec(i, 0, i % 3 == 0) for i in range(30)]  # 10 of 30 correct, one sample per item
    m = compute_metrics(one_each, [1], groups={i: "even" if i % 2 == 0 else "odd" for i in range(30)})
    acc = m["intervals"]["accuracy"]
    assert acc["method"] == "clopper-pearson" and (acc["low"], acc["high"]) == pytest.approx(clopper_pearson(10, 30))
    assert m["intervals"]["pass@1"]["method"] == "clopper-pearson"
    assert m["intervals"]["mean_reward"]["method"] == "clopper-pearson"
    even = m["groups"]["even"]  # items 0, 2, ..., 28: correct when divisible by 6 (0, 6, 12, 18, 24)
    assert even["num_items"] == 15 and even["accuracy"] == pytest.approx(5 / 15)
    assert (even["intervals"]["accuracy"]["low"], even["intervals"]["accuracy"]["high"]) == pytest.approx(
        clopper_pearson(5, 15))
    assert set(m["groups"]) == {"even", "odd"}

    four_each = [rec(i, s, s < i % 5) for i in range(12) for s in range(4)]
    m = compute_metrics(four_each, [1, 4])
    iv = m["intervals"]
    assert iv["accuracy"]["method"] == "bootstrap" and iv["pass@1"]["method"] == "bootstrap"
    assert iv["pass@4"]["method"] == "clopper-pearson"  # k = n: each item passes or not
    assert iv["accuracy"]["estimate"] == pytest.approx(m["accuracy"])
    assert iv["pass@4"]["estimate"] == pytest.approx(m["pass@4"])
    assert "groups" not in m
    assert compute_metrics([], [1])["intervals"] == {"mean_reward": None, "accuracy": None, "pass@1": None}


def test_item_scores_pair_items_by_id() -> None:
    records = [rec(0, 0, True), rec(0, 1, False), rec(1, 0, True), rec(1, 1, True),
               SampleRecord(item_index=2, sample_index=0, task_id="t2", status="error")]
    scores, binary = item_scores(records, "accuracy")
    assert [k.split("#")[0] for k in scores] == ["t0", "t1"] and list(scores.values()) == [0.5, 1.0]
    assert binary is False
    scores, binary = item_scores(records, "pass@2")
    assert list(scores.values()) == [1.0, 1.0] and binary is True
    other_prompt = [rec(0, 0, True, prompt="another question")]
    assert not set(item_scores(other_prompt, "accuracy")[0]) & set(scores)  # same id, another item: no pair
    assert item_scores(records, "pass@3") == ({}, True)
    for bad in ("pass@x", "pass@0", "f1"):
        with pytest.raises(ValueError):
            item_scores(records, bad)
