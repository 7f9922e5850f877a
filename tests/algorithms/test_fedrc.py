"""FedRC (Guo, Tang, Lin, ICML 2024): its robust E-step, label statistics and label shares
against hand computations, its first round against FedEM's (uniform label shares cancel),
a concept shift on real MNIST (labels shifted) split into two clusters, and the warning
when the soft assignment collapses into one."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import adjusted_rand_score

from fedcluster.algorithms.fedem import FedEM
from fedcluster.algorithms.fedrc import (
    LABEL_FLOOR,
    FedRC,
    label_shares,
    label_statistics,
    robust_e_step,
)
from fedcluster.data.federation import Federation
from fedcluster.protocol.batches import LocalTraining
from tests.helpers import make_context


def test_robust_e_step_equals_the_formula_on_a_hand_made_table():
    """γ_ik = ω_k e^{−ℓ_ik} / P̃_k(y_i) / Σ_j ω_j e^{−ℓ_ij} / P̃_j(y_i), ω'_k = mean_i γ_ik."""
    losses = torch.tensor([[0.2, 1.5], [2.0, 0.3], [0.9, 0.8]])
    labels = torch.tensor([0, 1, 1])
    omega = torch.tensor([0.6, 0.4])
    shares = torch.tensor([[0.9, 0.1], [0.3, 0.7]])  # P̃_k(c): cluster k, label c
    gamma, new = robust_e_step(losses, labels, omega, shares)
    for i in range(3):
        c = int(labels[i])
        terms = [
            omega[k].item() * math.exp(-losses[i, k].item()) / shares[k, c].item() for k in (0, 1)
        ]
        for k in (0, 1):
            assert gamma[i, k].item() == pytest.approx(terms[k] / sum(terms), rel=1e-12)
    assert new.tolist() == pytest.approx(gamma.mean(dim=0).tolist(), rel=1e-12)
    # sample 2 (label 1) fits model 1 slightly worse, but label 1 is rare in cluster 0:
    # dividing by P̃_0(1) = 0.1 moves it to cluster 0, where plain FedEM keeps it balanced
    assert gamma[2, 0] > 0.75


def test_label_statistics_and_shares_by_hand():
    gamma = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.5, 0.5], [1.0, 0.0]], dtype=torch.float64)
    labels = torch.tensor([2, 0, 2, 1])
    stats = label_statistics(gamma, labels, n_classes=4)
    want = torch.tensor(
        [[0.2, 1.0, 0.9 + 0.5, 0.0], [0.8, 0.0, 0.1 + 0.5, 0.0]], dtype=torch.float64
    )
    assert torch.allclose(stats, want)
    other = torch.full((2, 4), 0.25, dtype=torch.float64)  # a client that has not taken part
    shares = label_shares(torch.stack([stats, other]))
    total = want + other
    assert torch.allclose(shares, total / total.sum(dim=1, keepdim=True))
    floored = label_shares(stats[None])  # label 3 never seen: its share is the floor
    assert floored[0, 3].item() == pytest.approx(LABEL_FLOOR / (2.6 + LABEL_FLOOR), rel=1e-9)
    assert torch.allclose(floored.sum(dim=1), torch.ones(2, dtype=torch.float64))


@pytest.fixture(scope="module")
def concepts(shared_dataset) -> Federation:
    """8 clients of 200 real MNIST digits; clients 4-7 see every label shifted by 5 (a
    concept shift: the same images, another P(y|x))."""
    ds = shared_dataset("mnist")
    train, test = [], []
    for c in range(8):
        x = torch.as_tensor(ds.train.x[c * 200 : (c + 1) * 200])
        y = torch.as_tensor(ds.train.y[c * 200 : (c + 1) * 200])
        xt = torch.as_tensor(ds.test.x[c * 50 : (c + 1) * 50])
        yt = torch.as_tensor(ds.test.y[c * 50 : (c + 1) * 50])
        if c >= 4:
            y, yt = (y + 5) % 10, (yt + 5) % 10
        train.append((x, y))
        test.append((xt, yt))
    return Federation.from_clients(train, test, 10, groups=[0] * 4 + [1] * 4)


def _run(fed: Federation, seed: int, rounds: int) -> tuple[FedRC, object]:
    ctx = make_context(
        fed, seed=seed, train=LocalTraining(lr=0.05, batch_size=32, epochs=2), hidden=[64]
    )
    alg = FedRC(FedRC.Params(n_clusters=2), ctx)
    state = alg.init_state()
    for rnd in range(1, rounds + 1):
        ctx.channel.start_round()
        state = alg.run_round(state, rnd, np.arange(fed.n_clients)).state
    return alg, state


def test_first_round_with_uniform_shares_is_fedems(concepts):
    """Uniform label shares are the same for every cluster, so they cancel in γ: FedRC's
    first round is FedEM's from the same models."""
    out = []
    for cls, params in ((FedRC, FedRC.Params(n_clusters=2)), (FedEM, FedEM.Params(n_components=2))):
        ctx = make_context(concepts, train=LocalTraining(lr=0.1, batch_size=16), hidden=[16])
        alg = cls(params, ctx)
        state = alg.init_state()
        state.components = ctx.fresh_rows(2, "test/components")
        ctx.channel.start_round()
        out.append(alg.run_round(state, 1, np.arange(8)).state)
    fedrc, fedem = out
    assert torch.allclose(fedrc.components, fedem.components, atol=1e-6)
    assert torch.allclose(fedrc.weights, fedem.weights, atol=1e-9)
    # the uploaded statistics sum to each client's sample count
    assert torch.allclose(
        fedrc.statistics.sum(dim=(1, 2)), torch.as_tensor(concepts.train_sizes, dtype=torch.float64)
    )


def test_a_concept_shift_splits_the_clients(concepts):
    alg, state = _run(concepts, seed=0, rounds=20)
    assert adjusted_rand_score(concepts.groups, alg.clusters(state)) == 1.0
    shares = label_shares(state.statistics)
    assert torch.allclose(shares.sum(dim=1), torch.ones(2, dtype=torch.float64))


def test_a_collapse_into_one_cluster_is_a_warning(concepts, caplog):
    """Soft EM can let one model take every client (seed 1 here, after 12 rounds: the
    other model never wins a client); FedRC says so once."""
    alg, state = _run(concepts, seed=1, rounds=12)
    assert len(np.unique(alg.clusters(state))) == 1
    warned = [r for r in caplog.records if "collapsed into one cluster" in r.getMessage()]
    assert len(warned) == 1 and "fedrc round 11" in warned[0].getMessage()
