"""WeCFL (Ma et al. 2022): its weighted k-means against scikit-learn's, and its round
against FeSEM's when it stops after one average."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.cluster import KMeans

from fedcluster.algorithms.fesem import FeSEM
from fedcluster.algorithms.wecfl import WeCFL, weighted_lloyd
from fedcluster.clustering.validity import ari
from tests.algorithms.test_cflgt import MLP
from tests.algorithms.test_flhc_fesem import N, disjoint  # noqa: F401  (fixture)
from tests.helpers import FLOAT_BYTES, INT_BYTES, make_context


def test_weighted_lloyd_equals_sklearn_kmeans_with_sample_weight():
    """Hand-made rows where the weights move a centre far enough to re-assign a row:
    uniform weights would stop elsewhere."""
    rows = torch.tensor(
        [[0.0, 0.0], [1.0, 0.0], [2.2, 0.0], [4.0, 0.0], [5.0, 0.0], [9.0, 1.0], [10.0, 0.0]],
        dtype=torch.float64,
    )
    weights = np.array([1.0, 1.0, 1.0, 40.0, 1.0, 2.0, 1.0])
    init = torch.tensor([[0.0, 0.0], [3.0, 0.0], [10.0, 0.0]], dtype=torch.float64)
    first = torch.cdist(rows, init).argmin(dim=1).numpy()
    centres, labels = weighted_lloyd(rows, first, init, weights, max_iterations=100)
    ref = KMeans(3, init=init.numpy(), n_init=1, algorithm="lloyd", tol=0.0, max_iter=100)
    ref.fit(rows.numpy(), sample_weight=weights)
    assert np.array_equal(labels, ref.labels_)
    assert np.allclose(centres.numpy(), ref.cluster_centers_)
    uniform, _ = weighted_lloyd(rows, first, init, np.ones(7), max_iterations=100)
    assert not torch.allclose(uniform, centres)  # the weights matter here


def test_wecfl_with_one_iteration_is_fesem_with_sample_weights(disjoint):  # noqa: F811
    """One assignment and one average: FeSEM's round with data-size weights, the same
    models, clusters and bytes (the model and the sample count up per client)."""
    runs = []
    for cls, params in (
        (FeSEM, FeSEM.Params(n_clusters=4, weighting="samples")),
        (WeCFL, WeCFL.Params(n_clusters=4, max_iterations=1)),
    ):
        ctx = make_context(disjoint, **MLP)
        alg = cls(params, ctx)
        state = alg.init_state()
        for rnd in (1, 2):
            ctx.channel.start_round()
            state = alg.run_round(state, rnd, np.arange(N)).state
        runs.append((state, ctx.channel.traffic, ctx.dim))
    (fesem, t1, d), (wecfl, t2, _) = runs
    assert torch.equal(fesem.centres, wecfl.centres)
    assert np.array_equal(fesem.assign, wecfl.assign)
    assert t1 == t2 and t2.up == N * (d * FLOAT_BYTES + INT_BYTES)


def test_wecfl_separates_label_groups(disjoint):  # noqa: F811
    """Four label-disjoint groups of 4 clients: found from the first round on (seed 0;
    with seed 1 the k-means++ seeds land twice in one group and two groups merge, as
    for FeSEM)."""
    ctx = make_context(disjoint, **MLP)
    alg = WeCFL(WeCFL.Params(n_clusters=4), ctx)
    state = alg.init_state()
    for rnd in (1, 2):
        ctx.channel.start_round()
        state = alg.run_round(state, rnd, np.arange(N)).state
        assert ari(disjoint.groups, alg.clusters(state)) == 1.0
