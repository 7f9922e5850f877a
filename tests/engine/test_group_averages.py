"""The per-cluster mean, on a cluster's slice of rows or column block by column
block, equals the gather-then-average formula.

``cluster_average`` with the mean rule (JGL eq. 7, IFCA's model averaging)
used to gather each cluster's rows and take ``weighted_average`` of them;
:func:`fedcluster.engine.flat.group_averages` averages a cluster whose rows are
consecutive on their slice (no copy) and the others a block of columns at a
time. Every number must stay the same (the golden files pin
them): the tests compare with ``torch.equal``, not a tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcluster.algorithms.aggregation import cluster_average
from fedcluster.engine import flat
from fedcluster.engine.flat import group_averages, weighted_average


def _gathered(
    rows: torch.Tensor, labels: np.ndarray, previous: torch.Tensor, weights
) -> torch.Tensor:
    """The formula before the change: each cluster's rows gathered, then averaged."""
    out = previous.clone()
    w = torch.ones(len(labels)) if weights is None else torch.as_tensor(weights)
    for c in np.unique(labels):
        members = torch.as_tensor(labels == c)
        out[int(c)] = weighted_average(rows[members], w[members])
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
@pytest.mark.parametrize("block_bytes", [4 * 64 * 620, 4 * 1000 * 620, flat.GATHER_BYTES])
@pytest.mark.parametrize("weighted", [False, True])
def test_cluster_mean_equals_the_gathered_average_exactly(
    monkeypatch, block_bytes, weighted, order
):
    monkeypatch.setattr(flat, "GATHER_BYTES", block_bytes)
    rng = np.random.default_rng(block_bytes + weighted)
    labels = _labels(rng, order)
    d = 3_001
    rows = torch.randn(len(labels), d, generator=torch.Generator().manual_seed(int(weighted)))
    previous = torch.randn(5, d)
    weights = rng.integers(1, 500, len(labels)) if weighted else None
    got = cluster_average(rows, labels, previous, weights)
    assert torch.equal(got, _gathered(rows, labels, previous, weights))
    assert torch.equal(got[3], previous[3])  # a cluster without members keeps its row


def test_group_averages_names_the_groups_and_handles_no_rows():
    rows = torch.tensor([[1.0, 0.0], [3.0, 2.0], [10.0, 10.0]])
    names, means = group_averages(rows, np.array([7, 2, 7]), torch.tensor([1, 1, 3]))
    assert names.tolist() == [2, 7]
    assert torch.equal(means, torch.stack([rows[1], (rows[0] + 3 * rows[2]) / 4]))
    names, means = group_averages(rows[:0], np.array([], dtype=np.int64), torch.ones(0))
    assert len(names) == 0 and means.shape == (0, 2)
