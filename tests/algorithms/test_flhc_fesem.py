"""FL+HC and FeSEM on a small real-MNIST federation of 4 label-disjoint groups."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from fedcluster.algorithms.fesem import FeSEM, kmeanspp_seeds
from fedcluster.algorithms.flhc import FLHC
from fedcluster.clustering.validity import ari, purity
from fedcluster.data.federation import Federation
from fedcluster.engine.flat import weighted_average
from fedcluster.errors import ConfigError
from fedcluster.protocol.channel import Traffic
from tests.algorithms.test_cflgt import MLP, label_set_federation
from tests.helpers import FLOAT_BYTES, INT_BYTES, make_context

LABEL_SETS = [(0, 1, 2), (3, 4, 5), (6, 7), (8, 9)]
N = 16  # clients, 4 per label set


@pytest.fixture(scope="module")
def disjoint(shared_dataset) -> Federation:
    """16 clients of real MNIST digits, client i holding 40 images per label of set i % 4."""
    return label_set_federation(shared_dataset("mnist").train, LABEL_SETS, [40] * N)


# ---------------------------------------------------------------------- FL+HC
def test_flhc_params_cut_the_tree_exactly_one_way():
    assert FLHC.Params().n_clusters == 5
    assert FLHC.Params(distance_threshold=0.5).n_clusters is None
    with pytest.raises(ValidationError, match="exactly one"):
        FLHC.Params(n_clusters=3, distance_threshold=0.5)
    with pytest.raises(ValidationError, match="n_clusters or distance_threshold"):
        FLHC.Params(n_clusters=None)


@pytest.mark.parametrize(
    "cut",
    [
        {"n_clusters": 4},
        {"distance_threshold": 0.6},  # ward merges: < 0.2 within groups, > 1.7 across
        {"n_clusters": 4, "linkage": "complete"},
    ],
)
def test_flhc_recovers_the_groups(disjoint, cut):
    alg = FLHC(FLHC.Params(pretrain_rounds=1, **cut), make_context(disjoint, **MLP))
    state = alg.init_state()
    for rnd in (1, 2):
        state = alg.run_round(state, rnd, np.arange(N)).state
    assert ari(disjoint.groups, alg.clusters(state)) == 1.0


def test_flhc_schedule_bytes_and_determinism(disjoint):
    results = []
    for _ in range(2):
        ctx = make_context(disjoint, seed=5, **MLP)
        d = ctx.dim
        alg = FLHC(FLHC.Params(pretrain_rounds=1, n_clusters=4), ctx)
        state = alg.init_state()
        state = alg.run_round(state, 1, np.arange(0, N, 2)).state
        pretrained = state.global_model.clone()
        ctx.channel.traffic = Traffic()
        out = alg.run_round(state, 2, np.array([0]))  # every client trains and uploads
        state = out.state
        assert np.isfinite(out.loss)
        assert (
            ctx.channel.traffic.down == N * d * FLOAT_BYTES
            and ctx.channel.traffic.up == N * d * FLOAT_BYTES
        )
        assert torch.equal(state.models, pretrained.expand(4, -1))
        selected = np.array([0, 1, 4, 5, 6])  # the runner's selection: groups 0, 1, 0, 1, 2
        ctx.channel.traffic = Traffic()
        state = alg.run_round(state, 3, selected).state
        assert ctx.channel.traffic.down == 5 * d * FLOAT_BYTES
        assert ctx.channel.traffic.up == 5 * (d * FLOAT_BYTES + INT_BYTES)
        labels = alg.clusters(state)
        for k in range(4):
            members = selected[labels[selected] == k]
            if len(members) == 0:  # group 3's cluster had no participant
                assert torch.equal(state.models[k], pretrained)
                continue
            local = ctx.channel.backend.train(members, pretrained, ctx.train, 3).rows
            expected = weighted_average(local, torch.as_tensor(disjoint.train_sizes[members]))
            assert torch.allclose(state.models[k], expected, atol=1e-6)
        results.append(state)
    assert torch.equal(results[0].models, results[1].models)


def test_flhc_rejects_more_clusters_than_clients(disjoint):
    alg = FLHC(FLHC.Params(pretrain_rounds=0, n_clusters=N + 1), make_context(disjoint, **MLP))
    with pytest.raises(ConfigError, match="n_clusters"):
        alg.run_round(alg.init_state(), 1, np.arange(N))


# ---------------------------------------------------------------------- FeSEM
def test_kmeanspp_seeds_land_in_distinct_blobs():
    points = torch.cat([torch.randn(5, 3) * 0.01 + 10 * k for k in range(4)])
    distance = torch.cdist(points, points).numpy()
    for s in range(20):
        seeds = kmeanspp_seeds(distance, 4, np.random.default_rng(s))
        assert sorted(seeds // 5) == [0, 1, 2, 3]


def test_fesem_recovers_the_groups_in_few_rounds(disjoint):
    ctx = make_context(disjoint, **MLP)
    alg = FeSEM(FeSEM.Params(n_clusters=4), ctx)
    state = alg.init_state()
    rng = np.random.default_rng(0)
    for rnd in range(1, 4):
        selected = np.sort(rng.choice(N, N // 2, replace=False))
        ctx.channel.traffic = Traffic()
        state = alg.run_round(state, rnd, selected).state
        assert ctx.channel.traffic.down == ctx.channel.traffic.up == 8 * ctx.dim * FLOAT_BYTES
    assign = alg.clusters(state)
    seen = assign >= 0
    assert seen.sum() >= 12 and purity(disjoint.groups[seen], assign[seen]) >= 0.9
    rows, model_of = alg.eval_rows(state)
    assert torch.equal(rows[4], state.centres.mean(dim=0))
    assert np.array_equal(model_of, np.where(seen, assign, 4))


def test_fesem_e_and_m_steps(disjoint):
    ctx = make_context(disjoint, **MLP)
    alg = FeSEM(FeSEM.Params(n_clusters=4, weighting="samples"), ctx)
    state = alg.init_state()
    state = alg.run_round(state, 1, np.arange(0, N, 2)).state
    centres, assign = state.centres.clone(), state.assign.copy()
    selected = np.arange(N)  # half of them have no cluster yet: they start from the mean centre
    ctx.channel.traffic = Traffic()
    state = alg.run_round(state, 2, selected).state
    assert ctx.channel.traffic.up == N * (ctx.dim * FLOAT_BYTES + INT_BYTES)
    start = torch.where(torch.as_tensor(assign >= 0)[:, None], centres[assign], centres.mean(0))
    local = ctx.channel.backend.train(selected, start, ctx.train, 2).rows
    nearest = torch.cdist(local.double(), centres.double()).argmin(dim=1).numpy()
    assert np.array_equal(state.assign, nearest)
    for k in range(4):
        members = torch.as_tensor(nearest == k)
        sizes = torch.as_tensor(disjoint.train_sizes[members.numpy()])
        assert torch.allclose(state.centres[k], weighted_average(local[members], sizes))


def test_fesem_random_init_and_determinism(disjoint):
    runs = []
    for _ in range(2):
        alg = FeSEM(
            FeSEM.Params(n_clusters=4, init="random"), make_context(disjoint, seed=2, **MLP)
        )
        state = alg.init_state()
        assert len(torch.unique(state.centres, dim=0)) == 4
        losses = []
        for rnd in (1, 2):
            out = alg.run_round(state, rnd, np.arange(rnd, N, 3))
            state = out.state
            losses.append(out.loss)
        runs.append((losses, state))
    assert runs[0][0] == runs[1][0]
    assert torch.equal(runs[0][1].centres, runs[1][1].centres)
    assert np.array_equal(runs[0][1].assign, runs[1][1].assign)


def test_fesem_client_init_needs_k_clients(disjoint):
    alg = FeSEM(FeSEM.Params(n_clusters=4), make_context(disjoint, **MLP))
    with pytest.raises(ConfigError, match="n_clusters"):
        alg.run_round(alg.init_state(), 1, np.arange(3))


def test_fesem_e_step_on_the_device_equals_the_servers(disjoint):
    """The device's E-step (its trained model against the K released centres, the same
    distance) gives the server's assignments and hence the same centres, round by round;
    only the bytes differ (the centres down to every client, a centre id up)."""
    runs = []
    for on_device in (False, True):
        params = FeSEM.Params(n_clusters=4, init="random", choice_on_device=on_device)
        ctx = make_context(disjoint, seed=2, **MLP)
        alg = FeSEM(params, ctx)
        state = alg.init_state()
        history = []
        for rnd in (1, 2, 3):
            ctx.channel.start_round()
            state = alg.run_round(state, rnd, np.arange(rnd % 3, N, 2)).state
            history.append((state.centres.clone(), state.assign.copy()))
        runs.append(history)
    for (server_centres, server_assign), (device_centres, device_assign) in zip(*runs, strict=True):
        assert np.array_equal(server_assign, device_assign)
        assert torch.equal(server_centres, device_centres)
    assert len(np.unique(runs[1][0][1][runs[1][0][1] >= 0])) > 1  # round 1 used several centres


def test_fesem_choice_on_device_needs_random_centres(disjoint):
    alg = FeSEM(FeSEM.Params(n_clusters=4, choice_on_device=True), make_context(disjoint, **MLP))
    with pytest.raises(ConfigError, match="init: random"):
        alg.init_state()
