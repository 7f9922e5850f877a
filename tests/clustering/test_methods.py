"""Clustering methods: affinity propagation, K-Means++, hierarchical, Sattler's bipartition."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.exceptions import ConvergenceWarning

from fedcluster.clustering.distances import cosine_similarity_matrix, euclidean_distance_matrix
from fedcluster.clustering.methods import (
    affinity_propagation,
    affinity_propagation_exemplars,
    bipartition,
    hierarchical,
    kmeans_pp,
    relabel,
)
from fedcluster.clustering.validity import ari
from fedcluster.errors import ConfigError


def _blobs(n_per: int = 15, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    truth = np.repeat(np.arange(3), n_per)
    return centres[truth] + rng.normal(size=(truth.size, 2)), truth


def _assert_consecutive(labels: np.ndarray) -> None:
    assert labels.dtype == np.int64
    first = [labels[i] for i in sorted(np.unique(labels, return_index=True)[1])]
    assert first == list(range(len(first)))


def test_relabel_orders_by_first_appearance() -> None:
    np.testing.assert_array_equal(relabel(np.array([7, 7, 2, 9, 2])), [0, 0, 1, 2, 1])


def test_affinity_propagation_finds_three_blobs() -> None:
    x, truth = _blobs()
    labels = affinity_propagation(-euclidean_distance_matrix(torch.as_tensor(x)))
    assert labels.max() + 1 == 3
    assert ari(truth, labels) == 1.0
    _assert_consecutive(labels)


def test_affinity_propagation_preference_controls_count() -> None:
    x, _ = _blobs()
    sim = -euclidean_distance_matrix(torch.as_tensor(x)).numpy()
    counts = [affinity_propagation(sim, preference=p).max() + 1 for p in (-3.0, -1.0, 0.0)]
    assert 3 < counts[0] < counts[1] < counts[2] == sim.shape[0]  # higher preference, more
    with pytest.raises(ConfigError, match="preference"):
        affinity_propagation(sim, preference="mean")  # type: ignore[arg-type]


def test_affinity_propagation_without_exemplars_gives_one_cluster() -> None:
    x, _ = _blobs()
    with pytest.warns(ConvergenceWarning):
        labels = affinity_propagation(-euclidean_distance_matrix(torch.as_tensor(x)), max_iter=1)
    np.testing.assert_array_equal(labels, np.zeros(len(x), dtype=np.int64))


def test_affinity_propagation_exemplars_are_each_clusters_most_similar_point() -> None:
    """Every point's cluster is that of its most similar exemplar (Frey & Dueck's
    assignment), each exemplar lies in its own cluster, and the labels are those of
    :func:`affinity_propagation`."""
    x, truth = _blobs(n_per=12, seed=3)
    sim = -euclidean_distance_matrix(torch.as_tensor(x)).numpy()
    exemplars, labels = affinity_propagation_exemplars(sim)
    np.testing.assert_array_equal(labels, affinity_propagation(sim))
    assert ari(truth, labels) == 1.0
    np.testing.assert_array_equal(labels[exemplars], np.arange(len(exemplars)))
    np.testing.assert_array_equal(sim[:, exemplars].argmax(axis=1), labels)


def test_affinity_propagation_without_exemplars_names_the_medoid() -> None:
    x, _ = _blobs()
    sim = -euclidean_distance_matrix(torch.as_tensor(x)).numpy()
    with pytest.warns(ConvergenceWarning):
        exemplars, labels = affinity_propagation_exemplars(sim, max_iter=1)
    assert not labels.any()
    assert exemplars.tolist() == [int(sim.sum(axis=1).argmax())]  # the diagonal is 0


def test_kmeans_pp_recovers_blobs() -> None:
    x, truth = _blobs(seed=1)
    labels = kmeans_pp(torch.as_tensor(x), 3, random_state=0)
    assert ari(truth, labels) == 1.0
    _assert_consecutive(labels)


@pytest.mark.parametrize("linkage", ["complete", "average", "single"])
def test_hierarchical_on_distances(linkage: str) -> None:
    x, truth = _blobs(seed=2)
    dist = euclidean_distance_matrix(torch.as_tensor(x))
    labels = hierarchical(dist, n_clusters=3, linkage=linkage)  # type: ignore[arg-type]
    assert ari(truth, labels) == 1.0
    by_threshold = hierarchical(dist, distance_threshold=6.0, linkage=linkage)  # type: ignore[arg-type]
    np.testing.assert_array_equal(by_threshold, labels)


def test_hierarchical_ward_needs_features() -> None:
    x, truth = _blobs(seed=3)
    assert ari(truth, hierarchical(features=x, n_clusters=3, linkage="ward")) == 1.0
    with pytest.raises(ConfigError, match="ward"):
        hierarchical(euclidean_distance_matrix(torch.as_tensor(x)), n_clusters=3, linkage="ward")
    with pytest.raises(ConfigError, match="exactly one"):
        hierarchical(features=x, n_clusters=3, distance_threshold=1.0)
    with pytest.raises(ConfigError, match="exactly one"):
        hierarchical(n_clusters=3)


def test_bipartition_second_level_split_returns_client_ids() -> None:
    # Four groups of update directions: {0, 1} share +a, {2, 3} share -a; b and c split them
    # again. Complete linkage separates {0, 1} from {2, 3} first, then each half in two.
    rng = np.random.default_rng(4)
    dim, per_group = 40, 5
    a, b, c = np.linalg.qr(rng.normal(size=(dim, 3)))[0].T
    directions = np.stack([a + 0.5 * b, a - 0.5 * b, -a + 0.5 * c, -a - 0.5 * c])
    truth = np.repeat(np.arange(4), per_group)
    order = rng.permutation(truth.size)  # positions in the matrix are not grouped
    truth = truth[order]
    updates = directions[truth] + 0.05 * rng.normal(size=(truth.size, dim))
    client_ids = np.arange(100, 100 + truth.size)[rng.permutation(truth.size)]
    sim = cosine_similarity_matrix(torch.as_tensor(updates)).numpy()
    position = {cid: p for p, cid in enumerate(client_ids)}

    halves = bipartition(sim, client_ids)
    found = []
    for half in halves:
        pos = np.array([position[cid] for cid in half])
        found += bipartition(sim[np.ix_(pos, pos)], half)

    expected = [set(client_ids[truth == g]) for g in range(4)]
    assert sorted(map(sorted, map(set, found))) == sorted(map(sorted, expected))
    first_level = [set(client_ids[truth < 2]), set(client_ids[truth >= 2])]
    assert sorted(map(sorted, map(set, halves))) == sorted(map(sorted, first_level))
    assert client_ids[0] in halves[0]


def test_bipartition_checks_ids() -> None:
    with pytest.raises(ConfigError, match="client_ids"):
        bipartition(np.eye(3), np.arange(2))
