"""The per-cluster mean of :func:`fedcluster.engine.flat.group_averages`: the
members' scaled rows added one after the other, in row order.

``cluster_average`` with the mean rule (JGL eq. 7, IFCA's model averaging)
reads the rows once, however scattered the clusters are. Its result is fixed
bit for bit by the definition (each product ``v_j * x_j`` rounded, then added
to the running sum), so the tests compare with ``torch.equal`` against that
loop written out here, and with a rounding bound against the gemv of
:func:`weighted_average` (the formula it replaced; on the project's EPYC the
two agree bit for bit, which the golden files check on that machine).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcluster.algorithms.aggregation import cluster_average
from fedcluster.engine import flat, threads
from fedcluster.engine.flat import group_averages, weighted_average


def _sequential(
    rows: torch.Tensor, labels: np.ndarray, previous: torch.Tensor, weights
) -> torch.Tensor:
    """Each cluster's mean written as a loop over its members in row order."""
    out = previous.clone()
    w = torch.ones(len(labels)) if weights is None else torch.as_tensor(weights)
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        v = w[members].float() / w[members].float().sum()
        total = torch.zeros(rows.shape[1])
        for j, m in enumerate(members):
            total = total + v[j] * rows[m]
        out[int(c)] = total
    return out


# cluster sizes 1, 2, 17, 600 and an empty cluster (3); column counts not a multiple of a block
SIZES = {0: 17, 1: 1, 2: 600, 4: 2}


def _labels(rng: np.random.Generator, order: str) -> np.ndarray:
    """Cluster labels of the rows: shuffled, each cluster's rows consecutive (rows
    trained in cluster order), or clusters 2 and 4 consecutive and the rest shuffled."""
    runs = [np.full(k, c) for c, k in SIZES.items()]
    if order == "scattered":
        return rng.permutation(np.concatenate(runs))
    if order == "consecutive":
        return np.concatenate([runs[i] for i in rng.permutation(len(runs))])
    shuffled = rng.permutation(np.concatenate([runs[0], runs[1]]))
    return np.concatenate([runs[3], shuffled[:9], runs[2], shuffled[9:]])


@pytest.mark.parametrize("order", ["scattered", "consecutive", "mixed"])
@pytest.mark.parametrize("chunk_bytes", [4 * 1, 4 * 3001 * 7, flat.SCALE_BYTES])
@pytest.mark.parametrize("weighted", [False, True])
def test_cluster_mean_is_the_members_sum_in_row_order(monkeypatch, chunk_bytes, weighted, order):
    monkeypatch.setattr(flat, "SCALE_BYTES", chunk_bytes)
    rng = np.random.default_rng(chunk_bytes + weighted)
    labels = _labels(rng, order)
    d = 3_001
    rows = torch.randn(len(labels), d, generator=torch.Generator().manual_seed(int(weighted)))
    previous = torch.randn(5, d)
    weights = rng.integers(1, 500, len(labels)) if weighted else None
    got = cluster_average(rows, labels, previous, weights)
    assert torch.equal(got, _sequential(rows, labels, previous, weights))
    assert torch.equal(got[3], previous[3])  # a cluster without members keeps its row
    # the gemv it replaced sums the same terms in another order at most: within the
    # bound of n-term float32 summation, n * eps * sum |v_j x_j|
    w = torch.ones(len(labels)) if weights is None else torch.as_tensor(weights)
    for c in np.unique(labels):
        members = torch.as_tensor(labels == c)
        v = w[members].float() / w[members].float().sum()
        bound = members.sum() * torch.finfo().eps * (v[:, None] * rows[members]).abs().sum(0)
        gemv = weighted_average(rows[members], w[members])
        assert ((got[int(c)] - gemv).abs() <= bound).all()


@pytest.mark.parametrize("workers", [1, 3])
def test_the_column_split_between_workers_does_not_change_a_bit(monkeypatch, workers):
    monkeypatch.setattr(threads, "usable_workers", lambda n, adaptive=True: n)
    rng = np.random.default_rng(workers)
    labels = _labels(rng, "scattered")
    rows = torch.randn(len(labels), 1_001, generator=torch.Generator().manual_seed(workers))
    weights = torch.as_tensor(rng.integers(1, 500, len(labels)))
    intra = torch.get_num_threads()
    torch.set_num_threads(workers)
    try:
        names, means = group_averages(rows, labels, weights)
    finally:
        torch.set_num_threads(intra)
    expected = _sequential(rows, labels, torch.zeros(5, 1_001), weights)
    assert torch.equal(means, expected[torch.as_tensor(names)])


def test_group_averages_names_the_groups_and_handles_no_rows():
    rows = torch.tensor([[1.0, 0.0], [3.0, 2.0], [10.0, 10.0]])
    names, means = group_averages(rows, np.array([7, 2, 7]), torch.tensor([1, 1, 3]))
    assert names.tolist() == [2, 7]
    assert torch.equal(means, torch.stack([rows[1], (rows[0] + 3 * rows[2]) / 4]))
    names, means = group_averages(rows[:0], np.array([], dtype=np.int64), torch.ones(0))
    assert len(names) == 0 and means.shape == (0, 2)
