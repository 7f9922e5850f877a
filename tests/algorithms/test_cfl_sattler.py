"""Sattler et al.'s CFL: recursive bi-partitioning with real client ids, ε criteria, min size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcluster.algorithms.aggregation import cluster_average, eval_rows_with_average
from fedcluster.algorithms.base import RoundOutput
from fedcluster.algorithms.cfl import CFL, CFLState
from fedcluster.data.federation import Federation
from fedcluster.protocol.batches import LocalTraining
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


def run(
    alg: CFL, rounds: int, selected: np.ndarray | None = None
) -> tuple[CFLState, list[RoundOutput]]:
    """The state after ``rounds`` rounds and every round's output."""
    state = alg.init_state()
    chosen = np.arange(alg.ctx.n_clients) if selected is None else selected
    outs = []
    for rnd in range(1, rounds + 1):
        outs.append(alg.run_round(state, rnd, chosen))
        state = outs[-1].state
    return state, outs


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
    _, outs = run(alg, 1)
    mean_norm, max_norm = outs[0].diagnostics["c0/mean_norm"], outs[0].diagnostics["c0/max_norm"]
    assert 0.0 < mean_norm < max_norm


def test_partial_participation_never_splits_an_incomplete_cluster(permuted):
    selected = np.arange(permuted.n_clients - 1)
    state, _ = run(make_cfl(permuted, warmup_rounds=0, **ALWAYS), 3, selected)
    assert len(state.clusters) == 1


def test_bytes_and_determinism(permuted):
    alg = make_cfl(permuted, seed=4, warmup_rounds=1, min_cluster_size=3, **ALWAYS)
    state, outs = run(alg, 3)
    n, dim = permuted.n_clients, alg.ctx.dim  # the Comm counts all 3 rounds here
    assert alg.ctx.channel.traffic.down == 3 * n * dim * FLOAT_BYTES
    assert alg.ctx.channel.traffic.up == 3 * n * (
        dim * FLOAT_BYTES + INT_BYTES
    )  # update and sample count
    again, outs_again = run(
        make_cfl(permuted, seed=4, warmup_rounds=1, min_cluster_size=3, **ALWAYS), 3
    )
    assert [o.loss for o in outs] == [o.loss for o in outs_again]
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


def test_diagnostics_match_a_hand_computation(permuted):
    """c0/mean_norm and c0/max_norm are ‖Σ n_i Δθ_i / Σ n_i‖ and max ‖Δθ_i‖ of the round."""
    alg = make_cfl(permuted, warmup_rounds=5, eps1=0.3, eps2=0.7)
    state = alg.init_state()
    everyone = np.arange(alg.ctx.n_clients)
    start = state.models[0].clone()
    diag = alg.run_round(state, 1, everyone).diagnostics
    # The same local training again (its randomness derives from seed, purpose, round, client).
    rows = alg.ctx.channel.backend.train(everyone, start, alg.ctx.train, 1, "train").rows.double()
    sizes = permuted.train_sizes.astype(np.float64)
    updates = [(rows[i] - start.double()).numpy() for i in everyone]
    mean = sum(n * u for n, u in zip(sizes, updates, strict=True)) / sizes.sum()
    assert diag["c0/mean_norm"] == pytest.approx(float(np.sqrt((mean**2).sum())), rel=1e-5)
    assert diag["c0/max_norm"] == pytest.approx(max(np.sqrt((u**2).sum()) for u in updates))
    assert (diag["c0/eps1"], diag["c0/eps2"], diag["c0/split"]) == (0.3, 0.7, 0.0)
    assert set(diag) == {
        f"c0/{k}" for k in ("mean_norm", "max_norm", "eps1", "eps2", "split", "alpha_cross")
    }


def test_split_is_flagged_per_half(permuted):
    alg = make_cfl(permuted, warmup_rounds=1, min_cluster_size=3, **ALWAYS)
    state, outs = run(alg, 2)
    diag = outs[-1].diagnostics
    assert len(state.clusters) == 2
    assert diag["c0/split"] == diag["c1/split"] == 1.0
    assert diag["c0/mean_norm"] == diag["c1/mean_norm"]  # the halves report their parent's
    diag = alg.run_round(state, 3, np.arange(alg.ctx.n_clients)).diagnostics
    assert sum(v for k, v in diag.items() if k.endswith("/split")) in (0, 2)


def test_relative_thresholds_scale_with_the_first_rounds(permuted):
    """ε = fraction × the mean of the single cluster's ‖Δθ‖ over the reference rounds."""
    alg = make_cfl(
        permuted, warmup_rounds=10, thresholds="relative", reference_rounds=2, eps1=0.5, eps2=2.0
    )
    state = alg.init_state()
    assert alg.thresholds(state) == (0.0, float("inf"))  # nothing seen: no split possible
    seen = []
    for rnd in (1, 2, 3):
        out = alg.run_round(state, rnd, np.arange(alg.ctx.n_clients))
        state = out.state
        seen.append(out.diagnostics["c0/mean_norm"])
    unit = (seen[0] + seen[1]) / 2  # round 3 is past the reference rounds
    assert alg.thresholds(state) == pytest.approx((0.5 * unit, 2.0 * unit))
    scaled = make_cfl(permuted, warmup_rounds=10, eps1=0.5 * unit, eps2=2.0 * unit)
    assert scaled.thresholds(scaled.init_state()) == pytest.approx(alg.thresholds(state))
