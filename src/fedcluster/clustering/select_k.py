"""Choosing the number of clusters K: the mean silhouette of k-means over a range of K.

The silhouette of point i (Rousseeuw, "Silhouettes: a graphical aid to the
interpretation and validation of cluster analysis", J. Comput. Appl. Math. 20,
1987) is s(i) = (b(i) − a(i)) / max(a(i), b(i)), a(i) the mean distance to the
other points of its cluster, b(i) the least mean distance to the points of
another cluster. The partition of each K is k-means with k-means++ seeding;
the K whose partition has the largest mean silhouette is chosen (Kaufman &
Rousseeuw, "Finding Groups in Data", 1990, ch. 2: the silhouette
coefficient as the criterion for the number of clusters); ties go to the
smaller K. The silhouette is defined for 2 ≤ K ≤ n − 1, so K = 1 (no
clustering) cannot be chosen.

The points are client update vectors, compared by direction as CFL (Sattler
et al.) and FedGroup compare them: each row is scaled to unit length, so the
euclidean distance used by k-means and the silhouette is √(2 − 2 cos).
"""

from __future__ import annotations

import math

import numpy as np
from sklearn.metrics import silhouette_score

from fedcluster.clustering._inputs import ArrayLike, as_array
from fedcluster.clustering.methods import kmeans_pp
from fedcluster.errors import ConfigError, FedclusterError


def unit_rows(x: ArrayLike) -> np.ndarray:
    """The rows of ``x`` [n, d] scaled to unit L2 norm (a zero row stays zero)."""
    rows = as_array(x, "x", 2)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.where(norms > 0, norms, 1.0)


def silhouette_curve(
    x: ArrayLike, k_range: tuple[int, int], *, random_state: int = 0, n_init: int = 10
) -> dict[int, float]:
    """The mean silhouette of k-means on the unit-scaled rows of ``x`` for each K in
    ``k_range`` (inclusive); NaN where k-means finds fewer than 2 distinct clusters
    (identical rows)."""
    rows = unit_rows(x)
    lo, hi = k_range
    if not 2 <= lo <= hi <= rows.shape[0] - 1:
        raise ConfigError(
            f"k_range: the silhouette needs 2 <= K <= n - 1 = {rows.shape[0] - 1} "
            f"(n = {rows.shape[0]} clients), got [{lo}, {hi}]"
        )
    curve = {}
    for k in range(lo, hi + 1):
        labels = kmeans_pp(rows, k, random_state=random_state, n_init=n_init)
        found = len(np.unique(labels))
        ok = 2 <= found <= rows.shape[0] - 1
        curve[k] = float(silhouette_score(rows, labels)) if ok else math.nan
    return curve


def choose_k(curve: dict[int, float]) -> int:
    """The K of the largest finite criterion value (ties: the smaller K)."""
    finite = {k: v for k, v in curve.items() if math.isfinite(v)}
    if not finite:
        raise FedclusterError(
            "n_clusters: auto: no K of the range gives a silhouette (the updates are identical)"
        )
    best = max(finite.values())
    return min(k for k, v in finite.items() if v == best)
