"""Clustering methods used by the algorithms: thin, checked wrappers of scikit-learn.

Inputs may be torch tensors or NumPy arrays. Every method returns int64 NumPy
labels ``0..K-1`` numbered in order of first appearance (the cluster of the
first client is 0), so equal partitions give equal label arrays.
"""

from __future__ import annotations

from numbers import Real
from typing import Literal

import numpy as np
from sklearn.cluster import AgglomerativeClustering, KMeans
from sklearn.cluster import affinity_propagation as sk_affinity_propagation

from fedcluster.clustering._inputs import ArrayLike, as_array, as_labels, as_square
from fedcluster.errors import ConfigError

Linkage = Literal["complete", "average", "single", "ward"]


def relabel(labels: ArrayLike) -> np.ndarray:
    """``labels`` renumbered ``0..K-1`` in order of first appearance (int64)."""
    values = as_labels(labels, "labels")
    _, first, inverse = np.unique(values, return_index=True, return_inverse=True)
    rank = np.empty(first.size, dtype=np.int64)
    rank[np.argsort(first)] = np.arange(first.size)
    return rank[inverse.reshape(-1)]


def affinity_propagation(
    similarity: ArrayLike,
    *,
    preference: float | Literal["median"] = "median",
    damping: float = 0.5,
    max_iter: int = 200,
    convergence_iter: int = 15,
    random_state: int | None = 0,
) -> np.ndarray:
    """Affinity propagation (Frey & Dueck) on a precomputed similarity [n, n]; the count is found.

    Used by CFLGT (Alg. 1 line 11) and DCFL (Sec. II-B). Pass the **negative
    distance** (not squared), e.g. ``-trajectory_distance_matrix(T)``.
    ``preference`` sets how many clusters emerge (higher: more);
    ``"median"`` is the median of the off-diagonal similarities (Frey & Dueck's
    default; scikit-learn's own default would include the diagonal).
    ``random_state`` seeds scikit-learn's tie-breaking noise.

    If the message passing ends without any exemplar (scikit-learn warns with a
    ``ConvergenceWarning`` and would label every point -1), all clients are put
    in one cluster -- DCFL then re-clusters at the next round.
    """
    return affinity_propagation_exemplars(
        similarity,
        preference=preference,
        damping=damping,
        max_iter=max_iter,
        convergence_iter=convergence_iter,
        random_state=random_state,
    )[1]


def affinity_propagation_exemplars(
    similarity: ArrayLike,
    *,
    preference: float | Literal["median"] = "median",
    damping: float = 0.5,
    max_iter: int = 200,
    convergence_iter: int = 15,
    random_state: int | None = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`affinity_propagation` with its exemplars: ``(exemplars [K], labels [n])``,
    ``exemplars[k]`` the index of cluster k's exemplar (each point's cluster is that
    of its most similar exemplar). Where no exemplar emerged (one cluster of all),
    the exemplar is the point of largest total similarity to the others."""
    sim = as_square(similarity, "similarity")
    n = sim.shape[0]
    if n == 1:
        return np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    if preference == "median":
        pref = float(np.median(sim[~np.eye(n, dtype=bool)]))
    elif isinstance(preference, Real):
        pref = float(preference)
    else:
        raise ConfigError(f"preference: expected 'median' or a number, got {preference!r}")
    centers, labels = sk_affinity_propagation(
        sim,
        preference=pref,
        damping=damping,
        max_iter=max_iter,
        convergence_iter=convergence_iter,
        random_state=random_state,
    )
    if (labels < 0).all():
        off_diagonal = np.where(np.eye(n, dtype=bool), 0.0, sim)
        return np.array([int(off_diagonal.sum(axis=1).argmax())]), np.zeros(n, dtype=np.int64)
    new = relabel(labels)
    exemplars = np.empty(int(new.max()) + 1, dtype=np.int64)
    exemplars[new] = np.asarray(centers, dtype=np.int64)[labels]
    return exemplars, new


def kmeans_pp(
    x: ArrayLike, k: int, *, random_state: int | None = 0, n_init: int = 10
) -> np.ndarray:
    """K-Means with k-means++ seeding (Arthur & Vassilvitskii) of the rows of ``x`` [n, d].

    FedGroup (Alg. 3, line 14) clusters the EDC embedding
    ``cosine_to(updates, svd_directions(updates, m))`` with ``k = m``.
    """
    rows = as_array(x, "x", 2)
    if not 1 <= k <= rows.shape[0]:
        raise ConfigError(f"k: expected 1..{rows.shape[0]} clusters, got {k}")
    model = KMeans(n_clusters=k, init="k-means++", n_init=n_init, random_state=random_state)
    return relabel(model.fit_predict(rows))


def hierarchical(
    distance: ArrayLike | None = None,
    *,
    features: ArrayLike | None = None,
    n_clusters: int | None = None,
    distance_threshold: float | None = None,
    linkage: Linkage = "complete",
) -> np.ndarray:
    """Agglomerative clustering on a precomputed ``distance`` [n, n] or on ``features`` [n, d].

    Give exactly one of ``distance`` and ``features`` (features are compared by
    euclidean distance; ``linkage="ward"`` needs features), and exactly one of
    ``n_clusters`` and ``distance_threshold`` (clusters are merged while their
    linkage distance is below it). Used by FedGroup's MADC variant (complete
    linkage, Alg. 3 line 10), FL+HC (Briggs et al.) and Sattler's CFL
    (:func:`bipartition`).
    """
    if (distance is None) == (features is None):
        raise ConfigError("distance, features: give exactly one of them")
    if (n_clusters is None) == (distance_threshold is None):
        raise ConfigError("n_clusters, distance_threshold: give exactly one of them")
    if linkage == "ward" and features is None:
        raise ConfigError("linkage: 'ward' needs features (raw vectors), not a distance matrix")
    if distance is not None:
        data, metric = as_square(distance, "distance"), "precomputed"
    elif features is not None:
        data, metric = as_array(features, "features", 2), "euclidean"
    if data.shape[0] == 1:
        return np.zeros(1, dtype=np.int64)
    model = AgglomerativeClustering(
        n_clusters=n_clusters,
        metric=metric,
        linkage=linkage,
        distance_threshold=distance_threshold,
    )
    return relabel(model.fit_predict(data))


def bipartition(similarity: ArrayLike, client_ids: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Sattler et al.'s CFL split: two clusters by complete linkage on cosine similarities.

    ``similarity`` [n, n] holds the cosine similarities of the updates of the
    clients ``client_ids`` [n] (in that order), typically the sub-matrix of one
    cluster. Complete linkage runs on the dissimilarity ``1 - similarity``
    (the reference code uses ``-similarity``; complete linkage only compares
    distances, so the split is the same). Returns the two halves as arrays of
    the **client ids**, not of positions in the sub-matrix (the public
    reference code returns positions, which is wrong from the second split
    on); the first half holds ``client_ids[0]``.
    """
    sim = as_square(similarity, "similarity")
    ids = as_labels(client_ids, "client_ids", sim.shape[0])
    if ids.size < 2:
        raise ConfigError(f"client_ids: a split needs at least 2 clients, got {ids.size}")
    labels = hierarchical(1.0 - sim, n_clusters=2, linkage="complete")
    return ids[labels == 0], ids[labels == 1]
