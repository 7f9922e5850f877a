"""Cluster repair (algorithms/repair.py): split an incongruent cluster into a starved one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcluster.algorithms.fesem import FeSEM
from fedcluster.algorithms.ifca import IFCA
from fedcluster.algorithms.jgl import JGL
from fedcluster.algorithms.repair import ClusterRepair, repair_clusters, separation
from fedcluster.clustering.validity import purity
from fedcluster.protocol.batches import LocalTraining
from tests.helpers import make_context, rotated_digits

TRAIN = LocalTraining(lr=0.1, batch_size=16)


def test_separation_by_hand():
    sim = torch.tensor([[1.0, 0.8, -0.2], [0.8, 1.0, 0.0], [-0.2, 0.0, 1.0]])
    # within: the pair (0, 1) = 0.8 (twice, symmetric); across: -0.2, 0.0 (twice each)
    assert separation(sim, np.array([True, True, False])) == pytest.approx(0.8 - (-0.1))
    assert np.isnan(separation(sim, np.array([True, True, True])))


def test_repair_clusters_splits_two_directions_into_the_empty_cluster():
    old = torch.zeros(2, 3)
    old[1] = 9.0  # cluster 1: chosen by nobody
    rng = np.random.default_rng(0)
    ups = np.array([[1.0, 0, 0]] * 3 + [[0, 1.0, 0]] * 3) + 0.05 * rng.standard_normal((6, 3))
    rows = torch.as_tensor(ups, dtype=torch.float32)
    choice = np.zeros(6, dtype=np.int64)
    new = torch.stack([rows.mean(dim=0), old[1]])
    out = repair_clusters(ClusterRepair(), old, new, new - old, rows, choice, None)
    moved = out.choice == 1
    assert moved.sum() == 3 and (moved[:3].all() or moved[3:].all())
    torch.testing.assert_close(out.models[1], rows[torch.as_tensor(moved)].mean(dim=0))
    torch.testing.assert_close(out.models[0], rows[torch.as_tensor(~moved)].mean(dim=0))
    torch.testing.assert_close(out.delta[1], out.models[1] - old[0])  # from the model they trained
    assert out.splits == [(0, 1)] and out.separation[0] > 1.0 and np.isnan(out.separation[1])
    # Same directions with no starved cluster: nothing to re-seed, nothing changes.
    busy = np.array([0, 0, 0, 1, 1, 1])
    out = repair_clusters(ClusterRepair(), old, new, new - old, rows, busy, None)
    assert out.splits == [] and (out.choice == busy).all()
    torch.testing.assert_close(out.models, new)
    # One direction only (a congruent cluster): below the separation, no split.
    same = torch.as_tensor(np.array([[1.0, 0, 0]] * 6) + 0.05 * rng.standard_normal((6, 3)))
    out = repair_clusters(ClusterRepair(), old, new, new - old, same.float(), choice, None)
    assert out.splits == []


def _merged_start(alg, state):
    """Both true groups start in cluster 0: cluster 1's model has an absurd loss for everyone."""
    state.models[1] = state.models[0] * 50.0
    return state


@pytest.mark.parametrize("cls", [IFCA, JGL])
def test_repair_separates_two_groups_that_start_in_one_cluster(cls):
    fed = rotated_digits(n_groups=2, clients_per_group=4, per_client=80)
    everyone = np.arange(fed.n_clients)
    results = {}
    for repair in (None, ClusterRepair(after=0)):
        ctx = make_context(fed, "mlp", seed=0, train=TRAIN, hidden=[16])
        alg = cls(cls.Params(n_clusters=2, repair=repair), ctx)
        state = _merged_start(alg, alg.init_state())
        for rnd in range(1, 6):
            state = alg.run_round(state, rnd, everyone).state
        results[repair is None] = purity(fed.groups, state.assign)
    # Without repair the groups stay merged (JGL's empty-cluster fix moves one random client).
    assert results[True] <= 5 / 8
    assert results[False] == 1.0


def test_repair_that_never_splits_changes_nothing():
    fed = rotated_digits(n_groups=2, clients_per_group=3, per_client=60)
    everyone = np.arange(fed.n_clients)
    states, reports = [], []
    for repair in (None, ClusterRepair(separation=2.0, after=0)):
        ctx = make_context(fed, "mlp", seed=1, train=TRAIN, hidden=[8])
        alg = IFCA(IFCA.Params(n_clusters=3, repair=repair), ctx)
        state = alg.init_state()
        for rnd in range(1, 4):
            out = alg.run_round(state, rnd, everyone)
            state = out.state
        states.append(state)
        reports.append(out.diagnostics)
    torch.testing.assert_close(states[0].models, states[1].models, rtol=0, atol=0)
    assert (states[0].assign == states[1].assign).all()
    assert reports[1]["repair/splits"] == 0.0 and "repair/splits" not in reports[0]


def test_repair_measures_each_update_from_the_model_its_client_trained_from():
    """FeSEM's E-step can put a client into another cluster than the one it trained from:
    with ``starts`` the updates are w_i − start_i, so the same two directions split
    although the clients started from different models."""
    old = torch.zeros(2, 3)
    old[1] = 9.0
    rng = np.random.default_rng(1)
    ups = np.array([[1.0, 0, 0]] * 3 + [[0, 1.0, 0]] * 3) + 0.05 * rng.standard_normal((6, 3))
    starts = torch.as_tensor(rng.normal(size=(6, 3)) * 5.0, dtype=torch.float32)
    rows = starts + torch.as_tensor(ups, dtype=torch.float32)
    choice = np.zeros(6, dtype=np.int64)
    new = torch.stack([rows.mean(dim=0), old[1]])
    out = repair_clusters(ClusterRepair(), old, new, new - old, rows, choice, None, starts)
    moved = out.choice == 1
    assert out.splits == [(0, 1)] and (moved[:3].all() ^ moved[3:].all())
    # measured from the cluster model instead, the random starts hide the two directions
    blind = repair_clusters(ClusterRepair(), old, new, new - old, rows, choice, None)
    assert blind.separation[0] < out.separation[0]


def test_fesem_repair_separates_two_groups_that_start_in_one_cluster():
    fed = rotated_digits(n_groups=2, clients_per_group=4, per_client=80)
    everyone = np.arange(fed.n_clients)
    results = {}
    for repair in (None, ClusterRepair(after=0)):
        ctx = make_context(fed, "mlp", seed=0, train=TRAIN, hidden=[16])
        alg = FeSEM(FeSEM.Params(n_clusters=2, init="random", repair=repair), ctx)
        state = alg.init_state()
        state.centres[1] = state.centres[0] * 50.0  # nobody's nearest centre: both groups merged
        for rnd in range(1, 6):
            out = alg.run_round(state, rnd, everyone)
            state = out.state
        results[repair is None] = purity(fed.groups, state.assign)
        logged = out.diagnostics
        assert ("repair/splits" in logged) == (repair is not None)
    assert results[True] == 0.5  # without repair the far centre stays empty
    assert results[False] == 1.0


def test_repair_at_k8_splits_alike_groups_only_below_the_default_separation():
    """JGL's EMNIST setting (docs/reproduction.md): with K = 8, two true groups whose
    updates have cosine 0.9 share cluster 0 and cluster 7 is empty. By hand the split's
    separation is 1 - 0.9 = 0.1: the default threshold 0.3 keeps them merged, 0.03 splits
    them exactly, and the six congruent clusters (separation 0) are never split."""
    k, d = 8, 8
    a = torch.zeros(d)
    a[0] = 1.0
    b = torch.zeros(d)
    b[0], b[1] = 0.9, np.sqrt(1 - 0.81)  # unit vector, cos(a, b) = 0.9
    old = torch.zeros(k, d)
    old[1:7] = torch.arange(1, 7, dtype=torch.float32)[:, None]
    ups = [a] * 4 + [b] * 4 + [torch.eye(d)[2 + j % 6] for j in range(24)]
    choice = np.array([0] * 8 + [1 + j % 6 for j in range(24)])
    rows = old[choice] + torch.stack(ups)
    new = torch.stack(
        [rows[choice == c].mean(dim=0) if (choice == c).any() else old[c] for c in range(k)]
    )
    kept = repair_clusters(ClusterRepair(), old, new, new - old, rows, choice, None)
    assert kept.splits == [] and (kept.choice == choice).all()
    assert kept.separation[0] == pytest.approx(0.1, abs=1e-6)
    assert np.allclose(kept.separation[1:7], 0.0, atol=1e-6) and np.isnan(kept.separation[7])
    split = repair_clusters(ClusterRepair(separation=0.03), old, new, new - old, rows, choice, None)
    assert split.splits == [(0, 7)]
    moved = split.choice[:8] == 7
    assert moved.sum() == 4 and (moved[:4].all() or moved[4:].all())
    assert (split.choice[8:] == choice[8:]).all()
