"""Validity scores: purity, ARI/NMI, Dunn index, Hopkins statistic, coefficient of variation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcluster.clustering.validity import (
    ari,
    coefficient_of_variation,
    dunn_index,
    hopkins,
    nmi,
    purity,
)
from fedcluster.errors import ConfigError


def test_purity_known_assignments() -> None:
    truth = np.array([0, 0, 0, 1, 1, 2])
    assert purity(truth, np.array([2, 2, 2, 0, 0, 1])) == 1.0  # perfect up to renaming
    assert purity(truth, np.zeros(6, dtype=int)) == pytest.approx(3 / 6)  # largest group share
    # Cluster 0 = {0, 0}: majority 2; cluster 1 = {0, 1, 1, 2}: majority 2 -> 4 / 6.
    assert purity(truth, np.array([0, 0, 1, 1, 1, 1])) == pytest.approx(4 / 6)
    assert purity(torch.tensor(truth), torch.arange(6)) == 1.0  # singletons are pure
    with pytest.raises(ConfigError, match="pred"):
        purity(truth, np.zeros(5, dtype=int))


def test_ari_nmi_perfect_and_independent() -> None:
    truth = np.repeat(np.arange(3), 4)
    assert ari(truth, (truth + 1) % 3) == pytest.approx(1.0)
    assert nmi(truth, (truth + 1) % 3) == pytest.approx(1.0)
    assert nmi(truth, np.zeros(12, dtype=int)) == pytest.approx(0.0)


def _dist_1d(points: list[float]) -> np.ndarray:
    p = np.array(points)
    return np.abs(p[:, None] - p[None, :])


def test_dunn_index_by_hand() -> None:
    # Clusters {0, 1} and {5, 7}: nearest pair across = 1..5 = 4, widest inside = 5..7 = 2.
    assert dunn_index(_dist_1d([0, 1, 5, 7]), np.array([0, 0, 1, 1])) == pytest.approx(2.0)
    # {0, 3} and {4, 10}: across 3..4 = 1, inside 4..10 = 6.
    assert dunn_index(torch.tensor(_dist_1d([0, 3, 4, 10])), torch.tensor([0, 0, 1, 1])) == (
        pytest.approx(1 / 6)
    )
    # Three clusters {0, 2}, {10}, {13, 14}: across min(10-2, 13-10) = 3, inside max(2, 1) = 2.
    labels = np.array([0, 0, 1, 2, 2])
    assert dunn_index(_dist_1d([0, 2, 10, 13, 14]), labels) == pytest.approx(1.5)


def test_dunn_index_degenerate_cases() -> None:
    d = _dist_1d([0, 1, 5])
    assert dunn_index(d, np.zeros(3, dtype=int)) == 0.0  # one cluster: re-cluster
    assert dunn_index(d, np.arange(3)) == math.inf  # all singletons
    assert dunn_index(_dist_1d([0, 0, 5]), np.array([0, 1, 1])) == 0.0  # clusters touch


def test_hopkins_uniform_is_about_half() -> None:
    rng = np.random.default_rng(0)
    values = [hopkins(rng.uniform(size=(1000, 2)), sample_ratio=0.1, rng=rng) for _ in range(5)]
    assert 0.4 < float(np.mean(values)) < 0.6


def test_hopkins_blobs_show_clustering_tendency() -> None:
    rng = np.random.default_rng(1)
    centres = rng.uniform(-20, 20, size=(4, 3))
    x = np.repeat(centres, 50, axis=0) + 0.3 * rng.normal(size=(200, 3))
    assert hopkins(torch.tensor(x), sample_ratio=0.1, rng=rng) > 0.75
    with pytest.raises(ConfigError, match="sample_ratio"):
        hopkins(x, sample_ratio=0.0, rng=rng)


def test_hopkins_is_reproducible() -> None:
    x = np.random.default_rng(2).normal(size=(50, 2))
    first = hopkins(x, rng=np.random.default_rng(3))
    assert hopkins(x, rng=np.random.default_rng(3)) == first


def test_coefficient_of_variation() -> None:
    x = np.array([[1.0, 2.0], [2.0, 2.0], [3.0, 2.0]])
    np.testing.assert_allclose(coefficient_of_variation(x), [math.sqrt(2 / 3) / 2, 0.0])
    np.testing.assert_allclose(
        coefficient_of_variation(torch.tensor(x), axis=0, ddof=1), [0.5, 0.0]
    )
    assert coefficient_of_variation(x, axis=None) == pytest.approx(np.std(x) / np.mean(x))


def test_hopkins_is_independent_of_the_blas_kernels() -> None:
    """The neighbour distances come from a k-d tree, not BLAS: the statistic equals the one
    computed from exact pairwise distances in float64 with math.dist (summation of a fixed
    order), whatever kernels numpy's BLAS picks on this CPU."""
    data = np.random.default_rng(3).normal(size=(30, 12)) * 3.7
    value = hopkins(data, rng=np.random.default_rng(5))
    rng = np.random.default_rng(5)
    m = 3
    uniform = rng.uniform(data.min(axis=0), data.max(axis=0), size=(m, 12))
    u = [min(math.dist(p, q) for q in data) for p in uniform]
    picks = rng.choice(30, size=m, replace=False)
    w = [min(math.dist(data[i], data[j]) for j in range(30) if j != i) for i in picks]
    expected = sum(u) / (sum(u) + sum(w))
    assert abs(value - expected) <= 1e-14
