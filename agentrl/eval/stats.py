"""Uncertainty of evaluation metrics: a standard error and a 95 % interval for each mean, and a paired test of two
runs over the same items (scipy.stats does the arithmetic).

The unit is the **item**, not the sample: the samples of one item are not independent, so every interval treats
an item's samples as one cluster. A metric is a ratio over items ``i`` with a sum ``s_i`` and a count ``n_i``
(accuracy: correct samples / ok samples; mean reward: rewards / ok samples; pass@k: the item's pass@k / 1):

    estimate = sum(s_i) / sum(n_i)

- **binary** outcomes (each item is one 0/1 trial: one ok sample per item for accuracy and a 0/1 reward, or
  ``k = n_i`` for pass@k): the exact Clopper–Pearson interval of ``x = sum(s_i)`` successes in ``m`` items,
  ``[B(α/2; x, m-x+1), B(1-α/2; x+1, m-x)]`` with ``B`` the beta quantile, and the binomial standard error
  ``sqrt(p (1 - p) / m)``;
- otherwise, a percentile bootstrap over items (``resamples`` draws of ``m`` items with replacement, a fixed
  ``seed``: the same records always give the same interval); the standard error is the standard deviation of
  the bootstrap estimates. Fewer than 2 items: no bootstrap interval (None).

Two runs (:func:`compare_paired`) are compared on the items both scored, ``d_i = b_i - a_i`` per item: the
difference ``mean(d)``, its standard error ``std(d, ddof=1) / sqrt(m)``, a percentile bootstrap interval of it, and
a two-sided p-value — McNemar's exact test when both runs' outcomes are binary (the discordant items ``b > a``
among all discordant ones against Binomial(·, 1/2)), else a paired permutation test (the sign of each ``d_i``
flipped at random; exact when ``2**m <= resamples``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
from scipy import stats

LEVEL = 0.95
RESAMPLES = 2000
SEED = 0
_BATCH_CELLS = 2_000_000  # bootstrap draws held in memory at once (resamples x items)


@dataclass(frozen=True, slots=True)
class Interval:
    """A metric's estimate, standard error and ``level`` interval ``[low, high]`` over ``n`` items."""

    estimate: float
    stderr: float | None
    low: float | None
    high: float | None
    method: Literal["clopper-pearson", "bootstrap"]
    n: int
    level: float = LEVEL

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def clopper_pearson(successes: int, trials: int, level: float = LEVEL) -> tuple[float, float]:
    """The exact (Clopper–Pearson) interval of a binomial proportion. Raises ValueError for bad counts."""
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"a binomial interval needs 0 <= successes <= trials and trials >= 1, got "
                         f"{successes} of {trials}")
    ci = stats.binomtest(successes, trials).proportion_ci(confidence_level=level, method="exact")
    return float(ci.low), float(ci.high)


def _batch(n: int) -> int:
    return max(1, _BATCH_CELLS // max(1, n))


def _ratio(s: Any, c: Any, axis: int = -1) -> Any:
    return s.sum(axis=axis) / c.sum(axis=axis)


def _bootstrap(data: tuple[Any, ...], statistic: Any, *, level: float, seed: int,
               resamples: int) -> tuple[float, float, float | None]:
    """(low, high, standard error) of a percentile bootstrap over the paired rows of ``data``."""
    with warnings.catch_warnings():  # all-equal values: a zero-width interval, which is the right answer here
        warnings.simplefilter("ignore")
        res = stats.bootstrap(data, statistic, paired=True, vectorized=True, n_resamples=resamples,
                              method="percentile", confidence_level=level, batch=_batch(len(data[0])),
                              random_state=np.random.default_rng(seed))
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    est = float(statistic(*(np.asarray(d) for d in data)))
    if math.isnan(low) or math.isnan(high):  # scipy says nan when every resample is equal
        low = high = est
    se = float(res.standard_error)
    return low, high, se if math.isfinite(se) else None


def item_interval(sums: Sequence[float], counts: Sequence[float], *, binary: bool, level: float = LEVEL,
                  seed: int = SEED, resamples: int = RESAMPLES) -> Interval | None:
    """The interval of ``sum(sums) / sum(counts)`` over items (module docstring); None without items. ``binary``:
    each item is one 0/1 trial (every count 1, every sum 0 or 1; checked)."""
    s = np.asarray(sums, dtype=float)
    c = np.asarray(counts, dtype=float)
    if s.shape != c.shape or s.ndim != 1:
        raise ValueError(f"sums and counts must be two equally long lists, got {s.shape} and {c.shape}")
    m = len(s)
    if m == 0 or c.sum() <= 0:
        return None
    est = float(s.sum() / c.sum())
    if binary:
        if not (np.all(c == 1) and np.all((s == 0) | (s == 1))):
            raise ValueError("binary outcomes need one 0/1 trial per item")
        x = int(s.sum())
        low, high = clopper_pearson(x, m, level)
        return Interval(est, math.sqrt(est * (1 - est) / m), low, high, "clopper-pearson", m, level)
    if m < 2:
        return Interval(est, None, None, None, "bootstrap", m, level)
    low, high, se = _bootstrap((s, c), _ratio, level=level, seed=seed, resamples=resamples)
    return Interval(est, se, low, high, "bootstrap", m, level)


@dataclass(frozen=True, slots=True)
class PairedComparison:
    """Run b against run a over ``n`` shared items: ``difference = mean(b) - mean(a)``."""

    n: int
    mean_a: float
    mean_b: float
    difference: float
    stderr: float | None
    low: float | None
    high: float | None
    p_value: float
    test: Literal["mcnemar-exact", "paired-permutation"]
    interval_method: Literal["paired-bootstrap"] = "paired-bootstrap"
    level: float = LEVEL
    discordant: tuple[int, int] | None = None  # McNemar: items (b > a, a > b)

    @property
    def significant(self) -> bool:
        return self.p_value < 1 - self.level

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["discordant"] = list(self.discordant) if self.discordant is not None else None
        d["significant"] = self.significant
        return d


def _mean_axis(d: Any, axis: int = -1) -> Any:
    return d.mean(axis=axis)


def compare_paired(a: Sequence[float], b: Sequence[float], *, binary: bool, level: float = LEVEL,
                   seed: int = SEED, resamples: int = RESAMPLES) -> PairedComparison:
    """Whether run b differs from run a on the same items (``a[i]``, ``b[i]``: item i's score in each run; see the
    module docstring). ``binary``: every score is 0 or 1 (checked). Raises ValueError without items."""
    x = np.asarray(a, dtype=float)
    y = np.asarray(b, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"paired scores must be two equally long lists, got {x.shape} and {y.shape}")
    m = len(x)
    if m == 0:
        raise ValueError("no items to compare")
    d = y - x
    diff = float(d.mean())
    se = float(d.std(ddof=1) / math.sqrt(m)) if m >= 2 else None
    low = high = None
    if m >= 2:
        low, high, _ = _bootstrap((d,), _mean_axis, level=level, seed=seed, resamples=resamples)
    if binary:
        if not np.all(np.isin(x, (0.0, 1.0)) & np.isin(y, (0.0, 1.0))):
            raise ValueError("McNemar's test needs 0/1 scores")
        up, down = int(((y == 1) & (x == 0)).sum()), int(((y == 0) & (x == 1)).sum())
        p = float(stats.binomtest(up, up + down, 0.5).pvalue) if up + down else 1.0
        return PairedComparison(m, float(x.mean()), float(y.mean()), diff, se, low, high, p, "mcnemar-exact",
                                level=level, discordant=(up, down))
    if np.all(d == 0):
        p = 1.0
    else:
        res = stats.permutation_test((x, y), lambda u, v, axis=-1: (v - u).mean(axis=axis),
                                     permutation_type="samples", vectorized=True, n_resamples=resamples,
                                     alternative="two-sided", random_state=np.random.default_rng(seed))
        p = float(min(1.0, res.pvalue))
    return PairedComparison(m, float(x.mean()), float(y.mean()), diff, se, low, high, p, "paired-permutation",
                            level=level)
