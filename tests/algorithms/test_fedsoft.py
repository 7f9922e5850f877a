"""FedSoft (Ruan & Joe-Wong 2022): the importance estimation on a toy mixture, and the
server's importance-weighted aggregation and bytes after a round."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcluster.algorithms.fedsoft import FedSoft, importance_weights
from fedcluster.protocol.batches import LocalTraining
from tests.algorithms.test_flhc_fesem import N, disjoint  # noqa: F401  (fixture)
from tests.helpers import FLOAT_BYTES, INT_BYTES, make_context


def test_importance_weights_on_a_toy_mixture():
    """70 samples of N(−2, 1) and 30 of N(2, 1); three 'cluster models' with the Gaussian
    negative log-likelihoods of centres −2, 2 and 100 as losses. The best fit of a sample
    is the nearer centre, so u = the shares of x < 0 and x > 0, and the far cluster, which
    fits no sample, gets the smoother."""
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(70, generator=gen) - 2.0, torch.randn(30, generator=gen) + 2.0])
    centres = torch.tensor([-2.0, 2.0, 100.0])
    losses = (x[:, None] - centres[None, :]) ** 2 / 2.0
    u = importance_weights(losses, smoother=1e-3)
    assert u.tolist() == pytest.approx(
        [float((x < 0).sum()) / 100, float((x > 0).sum()) / 100, 1e-3]
    )


def test_fedsoft_aggregates_each_cluster_by_importance_and_counts_bytes(disjoint):  # noqa: F811
    ctx = make_context(disjoint, hidden=[16], train=LocalTraining(lr=0.1, batch_size=16))
    alg = FedSoft(FedSoft.Params(n_clusters=2), ctx)
    state = alg.init_state()
    ctx.channel.start_round()
    out = alg.run_round(state, 1, np.arange(N))
    state = out.state
    u = state.importance
    assert torch.allclose(u.sum(dim=1), torch.ones(N, dtype=torch.float64), atol=1e-3)
    n = torch.as_tensor(disjoint.train_sizes, dtype=torch.float64)
    for s in range(2):
        v = u[:, s] * n / (u[:, s] * n).sum()  # v_ks = u_ks n_k / Σ_k' u_k's n_k'
        assert torch.allclose(
            state.models[s], (v[:, None] * state.local.double()).sum(0).float(), atol=1e-6
        )
    d = ctx.dim
    assert ctx.channel.traffic.down == N * 2 * d * FLOAT_BYTES  # the local model is held
    assert ctx.channel.traffic.up == N * (d * FLOAT_BYTES + 2 * FLOAT_BYTES + INT_BYTES)
    assert set(alg.clusters(state)) <= {0, 1}
    assert out.diagnostics == {
        f"u/client{k}/c{s}": float(u[k, s]) for k in range(N) for s in range(2)
    }
