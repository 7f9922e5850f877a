"""Clustering validity: external scores against ground truth, internal indices, tendency.

Inputs may be torch tensors or NumPy arrays; results are Python floats (or a
NumPy array for :func:`coefficient_of_variation`).
"""

from __future__ import annotations

import numpy as np
from scipy.stats import variation
from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score
from sklearn.metrics.cluster import contingency_matrix
from sklearn.neighbors import NearestNeighbors

from fedcluster.clustering._inputs import ArrayLike, as_array, as_labels, as_square, to_numpy
from fedcluster.errors import ConfigError


def _label_pair(true: ArrayLike, pred: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    truth = as_labels(true, "true")
    return truth, as_labels(pred, "pred", truth.size)


def purity(true: ArrayLike, pred: ArrayLike) -> float:
    """JGL's clustering purity ``P = (1/M) sum_k max_j |M*_j ∩ M_k|`` (JGL Sec. III-A.3).

    ``M*_j`` are the true groups, ``M_k`` the predicted clusters, ``M`` the
    number of clients: each cluster counts the clients of its majority group.
    1 for a perfect clustering; putting everyone in one cluster gives the share
    of the largest group. Not symmetric in its arguments.
    """
    truth, predicted = _label_pair(true, pred)
    counts = contingency_matrix(truth, predicted)  # [true group, predicted cluster]
    return float(counts.max(axis=0).sum() / truth.size)


def purity_ceiling(group_sizes: ArrayLike, n_clusters: int) -> float:
    """The largest :func:`purity` any assignment into ``n_clusters`` clusters can reach.

    With groups of sizes ``s_1 >= s_2 >= ...`` (``M`` clients) the ceiling is
    ``(s_1 + ... + s_K) / M`` for K clusters, and 1 once K reaches the number
    of groups. Upper bound: each cluster counts the clients of one group, its
    majority, and a group's clients are counted at most once in total, so the
    sum is at most that of K distinct groups' sizes. Reached by giving the
    K − 1 largest groups a cluster each and putting all other groups into the
    last cluster, where the K-th largest group is the majority. E.g. FedGroup's
    m = 3 groups against 10 equal class-pair groups: 0.3.
    """
    sizes = np.sort(as_array(group_sizes, "group_sizes", 1))[::-1]
    if n_clusters < 1:
        raise ConfigError(f"n_clusters: expected at least 1 cluster, got {n_clusters}")
    if (sizes < 0).any() or sizes.sum() <= 0:
        raise ConfigError("group_sizes: expected non-negative sizes with a positive total")
    return float(min(1.0, sizes[:n_clusters].sum() / sizes.sum()))


def ari(true: ArrayLike, pred: ArrayLike) -> float:
    """Adjusted Rand index (scikit-learn): 1 for identical partitions, about 0 by chance."""
    return float(adjusted_rand_score(*_label_pair(true, pred)))


def nmi(true: ArrayLike, pred: ArrayLike) -> float:
    """Normalised mutual information (scikit-learn, arithmetic normalisation), in [0, 1]."""
    return float(normalized_mutual_info_score(*_label_pair(true, pred)))


def dunn_index(distance: ArrayLike, labels: ArrayLike) -> float:
    """DCFL's Dunn index (eq. 3): min inter-cluster (single linkage) / max intra-cluster distance.

    Numerator: the smallest distance between two clients of different
    clusters; denominator: the largest distance between two clients of the
    same cluster. DCFL re-clusters when there is a single cluster or DI < 1.
    Conventions for the degenerate cases:

    * a single cluster (no inter-cluster pair): **0.0**, so that ``DI < 1``
      alone triggers DCFL's re-clustering;
    * an inter-cluster distance of 0 (clients of different clusters coincide):
      0.0;
    * otherwise, no intra-cluster pair (all singletons) or an intra-cluster
      diameter of 0: ``inf``.
    """
    dist = as_square(distance, "distance")
    groups = as_labels(labels, "labels", dist.shape[0])
    same = groups[:, None] == groups[None, :]
    if same.all():
        return 0.0
    inter = dist[~same].min()
    intra_pairs = dist[same & ~np.eye(groups.size, dtype=bool)]
    intra = intra_pairs.max() if intra_pairs.size else 0.0
    if inter <= 0.0:
        return 0.0
    return float(inter / intra) if intra > 0.0 else float("inf")


def hopkins(x: ArrayLike, *, sample_ratio: float = 0.1, rng: np.random.Generator) -> float:
    """Hopkins statistic of the rows of ``x`` [n, d] (Banerjee & Dave 2004, as used by CFLGT).

    ``H = sum(u) / (sum(u) + sum(w))`` (distances, not raised to the power d):
    ``u`` are the distances from ``m = max(1, round(sample_ratio * n))`` points
    drawn uniformly in the bounding box of the data to their nearest data
    point, ``w`` the distances from ``m`` data points drawn without
    replacement to their nearest other data point. About 0.5 for uniform
    data, near 1 for clustered data; CFLGT reads H > 0.75 as a clustering
    tendency (90% confidence). All randomness comes from ``rng``.
    """
    data = as_array(x, "x", 2)
    n, d = data.shape
    if n < 2:
        raise ConfigError(f"x: the Hopkins statistic needs at least 2 points, got {n}")
    if not 0.0 < sample_ratio <= 1.0:
        raise ConfigError(f"sample_ratio: expected a value in (0, 1], got {sample_ratio}")
    m = max(1, round(sample_ratio * n))
    # a k-d tree sums each distance's squares in a fixed order: the same value on every
    # CPU (the brute-force route goes through BLAS, whose kernels differ between CPUs)
    neighbours = NearestNeighbors(n_neighbors=2, algorithm="kd_tree").fit(data)
    uniform = rng.uniform(data.min(axis=0), data.max(axis=0), size=(m, d))
    u = neighbours.kneighbors(uniform, n_neighbors=1)[0][:, 0]
    sample = data[rng.choice(n, size=m, replace=False)]
    w = neighbours.kneighbors(sample, n_neighbors=2)[0][:, 1]  # column 0: the point itself
    return float(u.sum() / (u.sum() + w.sum()))


def coefficient_of_variation(x: ArrayLike, axis: int | None = 0, ddof: int = 0) -> np.ndarray:
    """Coefficient of variation ``std / mean`` along ``axis`` (CFLGT Sec. III-C, heterogeneity).

    CFLGT reports it for each axis of all clients' trajectory points: pass the
    points as ``[n * C, 2]`` with ``axis=0``. Population standard deviation
    (``ddof=0``) by default; ``inf``/``nan`` where the mean is 0 (SciPy's
    ``variation``).
    """
    data = to_numpy(x).astype(np.float64, copy=False)
    return np.asarray(variation(data, axis=axis, ddof=ddof))
