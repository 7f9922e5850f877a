"""Sattler et al.'s CFL: recursive bi-partitioning with real client ids, ε criteria, min size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcluster.algorithms.aggregation import cluster_average, eval_rows_with_average
from fedcluster.algorithms.cfl import CFL
from fedcluster.data.federation import Federation
from fedcluster.engine.batches import LocalTraining
from tests.helpers import FLOAT_BYTES, INT_BYTES, make_context

N_GROUPS = 4
PER_GROUP = 5
ALWAYS = {"eps1": 1e9, "eps2": 0.0}  # both ε criteria hold: split whenever allowed


@pytest.fixture(scope="module")
def permuted(shared_dataset) -> Federation:
    """20 clients of real MNIST; client i (group i mod 4) sees label y as (y + 3·group) mod 10.

    Interleaved groups make a client's id differ from its position inside a
    sub-cluster, which is what the reference code's bug confuses.
    """
    ds = shared_dataset("mnist")
    rng = np.random.default_rng(1)
    n = N_GROUPS * PER_GROUP
    groups = np.arange(n) % N_GROUPS
    tr, te = rng.permutation(len(ds.train.y))[: n * 100], rng.permutation(len(ds.test.y))[: n * 20]
    train, test = [], []
    for c in range(n):
        shift = 3 * int(groups[c])
        i_tr = torch.as_tensor(tr[c * 100 : (c + 1) * 100])
        i_te = torch.as_tensor(te[c * 20 : (c + 1) * 20])
        train.append((ds.train.x[i_tr], (ds.train.y[i_tr] + shift) % 10))
        test.append((ds.test.x[i_te], (ds.test.y[i_te] + shift) % 10))
    return Federation.from_clients(train, test, 10, groups)


def make_cfl(federation: Federation, seed: int = 0, **params) -> CFL:
    train = LocalTraining(lr=0.1, batch_size=20)
    ctx = make_context(federation, "mlp", seed=seed, train=train, hidden=[32])
    return CFL(CFL.Params(**params), ctx)


def run(alg: CFL, rounds: int, selected: np.ndarray | None = None) -> tuple[dict, list[float]]:
    state = alg.init_state()
    chosen = np.arange(alg.ctx.n_clients) if selected is None else selected
    return state, [alg.run_round(state, rnd, chosen) for rnd in range(1, rounds + 1)]


def as_sets(clusters: list[np.ndarray]) -> set[frozenset[int]]:
    return {frozenset(c.tolist()) for c in clusters}


def test_second_level_splits_recover_all_groups_with_real_ids(permuted):
    alg = make_cfl(permuted, warmup_rounds=1, min_cluster_size=3, **ALWAYS)
    state, _ = run(alg, 6)
    truth = {frozenset(np.flatnonzero(permuted.groups == g).tolist()) for g in range(N_GROUPS)}
    assert as_sets(state.clusters) == truth
    assert len(state.split_rounds) == N_GROUPS - 1 and min(state.split_rounds) == 2
    labels = alg.clusters(state)
    assert all(len(set(permuted.groups[labels == c])) == 1 for c in range(N_GROUPS))
    assert state.models.shape == (N_GROUPS, alg.ctx.dim)
    assert alg.evaluate(state, 6).accuracy.mean() > 0.5


def test_min_cluster_size_is_respected(permuted):
    alg = make_cfl(permuted, warmup_rounds=1, min_cluster_size=2 * PER_GROUP, **ALWAYS)
    state, _ = run(alg, 5)
    assert [len(c) for c in state.clusters] == [2 * PER_GROUP, 2 * PER_GROUP]


@pytest.mark.parametrize(
    "params",
    [
        {"eps1": 1e-9, "eps2": 0.0},  # the cluster is never close enough to stationary
        {"eps1": 1e9, "eps2": 1e9},  # no client's update is large enough
        {"warmup_rounds": 10, **ALWAYS},  # still warming up
        {"gamma_max": 0.999, "warmup_rounds": 1, **ALWAYS},  # sqrt((1 - α_cross)/2) <= γ_max
    ],
)
def test_split_criteria_block_splits(permuted, params):
    state, _ = run(make_cfl(permuted, **params), 4)
    assert len(state.clusters) == 1 and state.split_rounds == []


def test_update_norms_are_reported(permuted):
    alg = make_cfl(permuted)
    state, _ = run(alg, 1)
    mean_norm, max_norm = state.update_norms[0]
    assert 0.0 < mean_norm < max_norm


def test_partial_participation_never_splits_an_incomplete_cluster(permuted):
    selected = np.arange(permuted.n_clients - 1)
    state, _ = run(make_cfl(permuted, warmup_rounds=0, **ALWAYS), 3, selected)
    assert len(state.clusters) == 1


def test_bytes_and_determinism(permuted):
    alg = make_cfl(permuted, seed=4, warmup_rounds=1, min_cluster_size=3, **ALWAYS)
    state, losses = run(alg, 3)
    n, dim = permuted.n_clients, alg.ctx.dim  # the Comm counts all 3 rounds here
    assert alg.ctx.channel.traffic.down == 3 * n * dim * FLOAT_BYTES
    assert alg.ctx.channel.traffic.up == 3 * n * (
        dim * FLOAT_BYTES + INT_BYTES
    )  # update and sample count
    again, losses_again = run(
        make_cfl(permuted, seed=4, warmup_rounds=1, min_cluster_size=3, **ALWAYS), 3
    )
    assert losses == losses_again
    assert torch.equal(state.models, again.models)
    assert as_sets(state.clusters) == as_sets(again.clusters)


def test_cluster_average_and_eval_fallback():
    rows = torch.tensor([[1.0, 0.0], [3.0, 2.0], [10.0, 10.0]])
    previous = torch.full((3, 2), -1.0)
    out = cluster_average(rows, np.array([0, 0, 2]), previous, weights=np.array([1, 3, 5]))
    assert torch.allclose(out, torch.tensor([[2.5, 1.5], [-1.0, -1.0], [10.0, 10.0]]))
    assert torch.equal(previous, torch.full((3, 2), -1.0))  # not modified
    assert torch.allclose(cluster_average(rows, np.array([1, 1, 1]), previous)[1], rows.mean(dim=0))
    models, index = eval_rows_with_average(out, np.array([2, -1, 0]))
    assert index.tolist() == [2, 3, 0]
    assert torch.allclose(models[3], out.mean(dim=0))
