"""Statistics over seeds: a mean's confidence interval and a paired test between methods.

A seed of a run fixes the partition, the initial model and every client's
batches, so two methods run on the same seeds see the same federations: their
results are *paired* by seed, and the comparison tests the per-seed
differences.

- :func:`mean_ci`: the mean of ``n`` per-seed results with its two-sided
  confidence interval from Student's t distribution with ``n - 1`` degrees of
  freedom, ``mean ± t_{1-α/2, n-1} · s / √n`` (``s`` the sample standard
  deviation): the interval for a mean whose standard deviation is itself
  estimated from few samples (Student, "The probable error of a mean",
  Biometrika 6(1), 1908).
- :func:`paired_test`: the paired t-test on the per-seed differences
  (``scipy.stats.ttest_rel``), with the differences' mean and its t interval.
  Chosen over the Wilcoxon signed-rank test because sweeps have few seeds:
  with ``n`` pairs Wilcoxon's exact two-sided p-value is at least ``2 / 2^n``
  (0.25 for 3 seeds, 0.0625 for 5), so below 6 seeds it can never reject at
  5 %; the t-test assumes roughly normal differences, which final accuracies
  of one method over seeds usually are. The Wilcoxon p-value is given beside it
  from 6 pairs on (``wilcoxon_p``), as a check that needs no normality.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats

WILCOXON_MIN_PAIRS = 6
"""Fewest pairs for which the Wilcoxon signed-rank test can reach p < 0.05 (2/2^6 = 0.031)."""


@dataclass(frozen=True)
class MeanCI:
    """A mean over ``n`` values with its confidence interval [``low``, ``high``] (NaN for n < 2)."""

    mean: float
    low: float
    high: float
    n: int
    confidence: float

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> MeanCI:
    """The mean of ``values`` with its Student t confidence interval (module docstring)."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("mean_ci: no values")
    mean = float(x.mean())
    if x.size < 2:
        return MeanCI(mean, math.nan, math.nan, int(x.size), confidence)
    sem = float(x.std(ddof=1)) / math.sqrt(x.size)
    half = float(stats.t.ppf(0.5 + confidence / 2, x.size - 1)) * sem
    return MeanCI(mean, mean - half, mean + half, int(x.size), confidence)


@dataclass(frozen=True)
class PairedTest:
    """Method ``a`` against ``b`` on the same seeds: the mean of a − b, its interval, p-values."""

    a: str
    b: str
    n: int
    difference: MeanCI
    t_p: float
    wilcoxon_p: float | None

    def to_dict(self) -> dict[str, object]:
        return {
            "a": self.a,
            "b": self.b,
            "n": self.n,
            "test": "paired t-test",
            "difference": self.difference.to_dict(),
            "t_p": self.t_p,
            "wilcoxon_p": self.wilcoxon_p,
        }


def paired_test(
    a: str, values_a: Sequence[float], b: str, values_b: Sequence[float], confidence: float = 0.95
) -> PairedTest:
    """The paired t-test of ``values_a`` against ``values_b`` (the same seeds, in order)."""
    xa, xb = np.asarray(values_a, dtype=float), np.asarray(values_b, dtype=float)
    if xa.shape != xb.shape:
        raise ValueError(f"paired_test: {a} has {xa.size} values, {b} {xb.size}")
    diff = xa - xb
    if diff.size < 2:
        t_p = math.nan
    elif np.all(diff == diff[0]):  # no spread: t is ±inf (p = 0) or 0/0 (p = 1)
        t_p = 1.0 if diff[0] == 0 else 0.0
    else:
        t_p = float(stats.ttest_rel(xa, xb).pvalue)
    wilcoxon_p = None
    if diff.size >= WILCOXON_MIN_PAIRS:
        wilcoxon_p = 1.0 if np.all(diff == 0) else float(stats.wilcoxon(xa, xb).pvalue)
    return PairedTest(a, b, int(diff.size), mean_ci(diff, confidence), t_p, wilcoxon_p)
