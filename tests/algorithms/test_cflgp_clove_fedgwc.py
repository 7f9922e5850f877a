"""CFL-GP, CLoVE and FedGWC: each core step against a direct computation on hand-made
inputs, and each method on a small federation with cluster structure."""

from __future__ import annotations

import csv
import logging

import numpy as np
import pytest
import torch
from sklearn.cluster import KMeans, SpectralClustering
from sklearn.manifold import SpectralEmbedding
from sklearn.metrics import davies_bouldin_score

from fedcluster.algorithms import cflgp
from fedcluster.algorithms.cflgp import CFLGP, match_labels, profile_embedding, profile_partition
from fedcluster.algorithms.clove import CLoVE, group_loss_vectors, match_groups_to_models
from fedcluster.algorithms.fedgwc import (
    FedGWC,
    best_split,
    gaussian_rewards,
    interaction_similarity,
    update_interactions,
)
from fedcluster.clustering.validity import ari
from fedcluster.config.schema import validate_config
from fedcluster.data.federation import Federation
from fedcluster.data.sources import load_dataset
from fedcluster.errors import ConfigError
from fedcluster.experiment.runner import Experiment
from tests.helpers import FLOAT_BYTES, INT_BYTES, make_context, rotated_digits, rotated_mnist5k

SMALL_MLP = {"hidden": [32]}


@pytest.fixture(scope="module")
def rotations() -> Federation:
    """16 clients of scikit-learn's digits, 4 rotation groups (client c in group c % 4)."""
    return rotated_digits(n_groups=4, clients_per_group=4, per_client=80)


def run(alg, ctx, rounds: range, selected=None, seed: int = 0):
    """The state after ``rounds`` (all clients, or ``selected(rng)`` each round) and
    the last round's output."""
    state = alg.init_state()
    rng = np.random.default_rng(seed)
    out = None
    for rnd in rounds:
        ctx.channel.start_round()
        clients = np.arange(ctx.n_clients) if selected is None else selected(rng)
        out = alg.run_round(state, rnd, clients)
        state = out.state
    return state, out


# ---------------------------------------------------------------------- CFL-GP
def test_profile_embedding_is_the_projection_on_the_top_singular_vectors():
    """P_Kᵀ G from numpy's SVD of G (profiles as columns) equals the embedding up to
    the sign of each component; k-means of both gives one partition."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 40)) * 3.0
    profiles = np.concatenate([c + rng.normal(size=(5, 40)) for c in centres])
    g = profiles.T
    p, s, _ = np.linalg.svd(g, full_matrices=False)
    expected = (p[:, :3].T @ g).T
    points, singular = profile_embedding(torch.as_tensor(profiles), 3)
    signs = np.sign((points * expected).sum(axis=0))
    scale = np.abs(expected).max()
    assert np.allclose(points * signs, expected, atol=1e-10 * scale)
    assert np.allclose(singular, s, atol=1e-10 * s[0])
    labels, _ = profile_partition(torch.as_tensor(profiles), 3, seed=7)
    direct = KMeans(3, init="k-means++", n_init=10, random_state=7).fit_predict(expected)
    assert ari(direct, labels) == 1.0
    assert ari(np.repeat(np.arange(3), 5), labels) == 1.0


def test_match_labels_keeps_the_most_clients_in_place():
    old = np.array([0, 0, 0, 1, 1, 2, 2, 2])
    new = np.array([2, 2, 1, 0, 0, 1, 1, 1])  # the same grouping but client 2, renamed
    matched = match_labels(new, old, 3)
    assert matched.tolist() == [0, 0, 2, 1, 1, 2, 2, 2]
    best = max(
        int((np.array(perm)[new] == old).sum())
        for perm in [(0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0)]
    )
    assert int((matched == old).sum()) == best


def test_cflgp_profile_is_the_cumulative_average_of_updates(rotations):
    """Two clustering rounds at the same model (rotate off, period 1): each client's
    block 0 is the mean of its two updates θ_1 − θ_i', each taken from θ_1 as it was."""
    ctx = make_context(rotations, **SMALL_MLP)
    alg = CFLGP(CFLGP.Params(n_clusters=4, period=1, rotate=False), ctx)
    state = alg.init_state()
    updates = []
    for rnd in (1, 2):
        ctx.channel.start_round()
        start = state.models[0]
        probe = ctx.exchange(np.arange(16), start, rnd, purpose="profile")  # the same draws
        updates.append(start - probe.rows)
        state = alg.run_round(state, rnd, np.arange(16)).state
    expected = (updates[0] + updates[1]) / 2
    assert np.array_equal(state.counts[:, 0], np.full(16, 2))
    assert torch.allclose(state.profiles[:, 0], expected, atol=1e-6)
    assert not state.profiles[:, 1:].any()


def test_cflgp_finds_the_rotation_groups_in_its_first_clustering_round(rotations):
    ctx = make_context(rotations, **SMALL_MLP)
    alg = CFLGP(CFLGP.Params(n_clusters=4), ctx)
    state, out = run(alg, ctx, range(1, 2))
    assert ari(rotations.groups, alg.clusters(state)) == 1.0
    assert out.diagnostics["cflgp/block"] == 0.0 and out.diagnostics["cflgp/gap"] > 1.2
    d = ctx.dim
    # the profile (θ_1 down, update up) and the training (model down, model and size up)
    assert ctx.channel.traffic.down == 2 * 16 * d * FLOAT_BYTES
    assert ctx.channel.traffic.up == 16 * d * FLOAT_BYTES + 16 * (d * FLOAT_BYTES + INT_BYTES)
    state, _ = run(alg, ctx, range(1, 6))  # the models take turns; clusters stay
    assert ari(rotations.groups, alg.clusters(state)) == 1.0
    assert (state.counts[:, :3] == 1).all() and not state.counts[:, 3].any()


def test_cflgp_under_partial_participation_clusters_the_profiled_clients(rotations):
    """Half the clients a round, clustering every round at θ_1 (``rotate: false``): a
    client is clustered once it has a profile, unprofiled clients keep cluster 0, and
    a client's cluster does not change name between clustering rounds (the matching)."""
    ctx = make_context(rotations, **SMALL_MLP)
    alg = CFLGP(CFLGP.Params(n_clusters=4, period=1, rotate=False), ctx)
    state = alg.init_state()
    rng = np.random.default_rng(1)
    seen = np.zeros(16, dtype=bool)
    previous = None
    for rnd in (1, 2, 3):
        ctx.channel.start_round()
        selected = np.sort(rng.choice(16, 8, replace=False))
        state = alg.run_round(state, rnd, selected).state
        seen[selected] = True
        labels = alg.clusters(state)
        assert np.array_equal(state.counts.sum(axis=1) > 0, seen)
        assert (labels[~seen] == 0).all()
        assert ari(rotations.groups[seen], labels[seen]) == 1.0
        if previous is not None:
            both = previous[1] & seen
            assert np.array_equal(labels[both], previous[0][both])
        previous = (labels, seen.copy())


def test_cflgp_warns_when_partial_participation_meets_rotating_profiles(rotations, caplog):
    ctx = make_context(rotations, **SMALL_MLP)
    alg = CFLGP(CFLGP.Params(n_clusters=4, period=1), ctx)
    halves = iter([np.arange(0, 16, 2), np.arange(1, 16, 2), np.arange(16)])
    with caplog.at_level(logging.WARNING, logger="fedcluster"):
        state, _ = run(alg, ctx, range(1, 4), selected=lambda rng: next(halves))
    assert (state.counts.sum(axis=1) > 0).all()
    assert len([r for r in caplog.records if "different models" in r.message]) == 1


def test_cflgp_projection_keeps_the_same_coordinates_and_still_clusters(rotations):
    ctx = make_context(rotations, **SMALL_MLP)
    alg = CFLGP(CFLGP.Params(n_clusters=4, profile_coordinates=300), ctx)
    again = CFLGP(CFLGP.Params(n_clusters=4, profile_coordinates=300), ctx)
    assert alg.coordinates is not None and torch.equal(alg.coordinates, again.coordinates)
    state, _ = run(alg, ctx, range(1, 2))
    assert state.profiles.shape == (16, 4, 300)
    assert ari(rotations.groups, alg.clusters(state)) == 1.0


def test_cflgp_refuses_a_profile_too_large_and_names_what_fits(rotations, monkeypatch):
    ctx = make_context(rotations, **SMALL_MLP)
    monkeypatch.setattr(cflgp, "PROFILE_BYTES", 16 * 4 * 100 * 4)  # 100 coordinates fit
    with pytest.raises(ConfigError, match="profile_coordinates: 100 "):
        CFLGP(CFLGP.Params(n_clusters=4), ctx)
    assert CFLGP(CFLGP.Params(n_clusters=4, profile_coordinates=100), ctx).width == 100


def test_cflgp_warns_when_the_profile_has_no_cluster_structure(caplog):
    """One group only: the last clustering round finds no 4-cluster structure."""
    fed = rotated_digits(n_groups=1, clients_per_group=8, per_client=60)
    ctx = make_context(fed, **SMALL_MLP)
    alg = CFLGP(CFLGP.Params(n_clusters=4, stop_after=1, warn_gap=3.0), ctx)
    with caplog.at_level(logging.WARNING, logger="fedcluster"):
        _, out = run(alg, ctx, range(1, 2))
    assert out.diagnostics["cflgp/gap"] < 3.0
    assert any("no 4-cluster structure" in r.message for r in caplog.records)


# ---------------------------------------------------------------------- CLoVE
def test_clove_groups_loss_vectors_and_matches_them_to_distinct_models():
    """The example of the paper's introductory figure: both groups have their lowest
    loss on θ_1 (IFCA would put all on it), their loss vectors still separate, and the
    groups take distinct models with the least total loss."""
    rng = np.random.default_rng(0)
    first = np.array([1.0, 5.1]) + 0.05 * rng.normal(size=(6, 2))
    second = np.array([2.1, 3.5]) + 0.05 * rng.normal(size=(6, 2))
    losses = np.concatenate([first, second])
    assert (losses.argmin(axis=1) == 0).all()
    groups = group_loss_vectors(losses, 2, seed=3)
    direct = KMeans(2, init="k-means++", n_init=10, random_state=3).fit_predict(losses)
    assert ari(direct, groups) == 1.0 and ari(np.repeat([0, 1], 6), groups) == 1.0
    models = match_groups_to_models(losses, groups)[groups]
    assert models.tolist() == [0] * 6 + [1] * 6
    # brute force over the two assignments of 2 groups to 2 models
    cost = [[losses[groups == g][:, k].mean() for k in range(2)] for g in range(2)]
    options = {(0, 1): cost[0][0] + cost[1][1], (1, 0): cost[0][1] + cost[1][0]}
    assert tuple(match_groups_to_models(losses, groups)) == min(options, key=options.get)


def test_clove_with_fewer_distinct_loss_vectors_than_models():
    """Three clients, four models: three groups, each on its own model."""
    losses = np.array([[1.0, 2.0, 3.0, 4.0], [4.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]])
    groups = group_loss_vectors(losses, 4, seed=0)
    assert groups.tolist() == [0, 1, 0]
    assert match_groups_to_models(losses, groups).tolist() == [0, 1]


def test_clove_counts_the_loss_vectors_it_uploads_and_refuses_device_choice(rotations):
    ctx = make_context(rotations, **SMALL_MLP)
    alg = CLoVE(CLoVE.Params(n_clusters=4), ctx)
    run(alg, ctx, range(1, 2))
    d = ctx.dim
    # K models down; K losses up; the chosen model down again is held (IFCA's rule)
    assert ctx.channel.traffic.down == 16 * 4 * d * FLOAT_BYTES
    assert ctx.channel.traffic.up == 16 * 4 * FLOAT_BYTES + 16 * (d * FLOAT_BYTES + INT_BYTES)
    with pytest.raises(ConfigError, match="clove.choice_on_device"):
        CLoVE(CLoVE.Params(choice_on_device=True), ctx)


def test_clove_recovers_the_rotation_groups(rotations):
    """Random initial models: the loss vectors separate the 4 rotations within 10
    rounds (seed 0), and the grouping's silhouette is high by then."""
    ctx = make_context(rotations, **SMALL_MLP)
    alg = CLoVE(CLoVE.Params(n_clusters=4), ctx)
    state, out = run(alg, ctx, range(1, 11))
    assert ari(rotations.groups, alg.clusters(state)) == 1.0
    assert out.diagnostics["clove/silhouette"] > 0.5


def test_clove_loss_vectors_are_released_under_client_level_local_dp(tmp_path):
    """The loss vector leaves the device: released under client-level DP (the run
    spends budget on it beside the models) and refused at record level."""
    config = {
        "name": "clove-dp",
        "seeds": [0],
        "rounds": 1,
        "data": rotated_mnist5k(6),
        "model": {"name": "mlp", "options": {"hidden": [16]}},
        "algorithms": [{"name": "clove", "params": {"n_clusters": 2}}],
    }
    client = {**config, "privacy": {"mode": "client", "epsilon": 5.0, "max_participations": 2}}
    Experiment(validate_config(client)).run(tmp_path / "client", progress=False)
    with open(tmp_path / "client/metrics.csv", newline="") as f:
        (row,) = csv.DictReader(f)
    assert float(row["epsilon"]) > 0
    record = {**config, "privacy": {"mode": "record", "epsilon": 5.0, "max_participations": 1}}
    with pytest.raises(ConfigError, match="cannot release the loss-vectors upload"):
        Experiment(validate_config(record)).run(tmp_path / "record", progress=False)


# ---------------------------------------------------------------------- FedGWC
def test_gaussian_rewards_equal_the_formula():
    losses = np.array([0.5, 1.0, 2.0, 4.0])
    sizes = np.array([10.0, 30.0, 20.0, 40.0])
    mu = sum(s * x for s, x in zip(sizes, losses, strict=True)) / sizes.sum()
    var = sum(s * (x - mu) ** 2 for s, x in zip(sizes, losses, strict=True)) / sizes.sum()
    expected = [np.exp(-((x - mu) ** 2) / (2 * var)) for x in losses]
    assert np.allclose(gaussian_rewards(losses, sizes), expected, rtol=1e-12)
    assert np.allclose(gaussian_rewards(np.full(3, 0.7), np.ones(3)), 1.0)


def test_interaction_update_and_similarity_equal_their_formulas():
    rng = np.random.default_rng(1)
    w = rng.random((6, 6)) / 36
    clients = np.array([1, 3, 4])
    rewards = np.array([0.2, 0.9, 0.5])
    alpha = 0.5
    new, change = update_interactions(w, clients, rewards, alpha)
    expected = w.copy()
    for a, i in enumerate(clients):
        for j in clients:
            expected[i, j] = (1 - alpha) * w[i, j] + alpha * rewards[a] / rewards.sum()
    assert np.allclose(new, expected, rtol=1e-14)
    assert np.isclose(change, ((expected - w)[np.ix_(clients, clients)] ** 2).mean())
    gamma = 3.0
    v = (new - new.min()) / (new.max() - new.min())
    loop = np.zeros((6, 6))
    for i in range(6):
        for j in range(6):
            if i != j:
                keep = [k for k in range(6) if k not in (i, j)]
                loop[i, j] = np.exp(-gamma * ((v[i, keep] - v[j, keep]) ** 2).sum())
    assert np.allclose(interaction_similarity(new, gamma), loop, atol=1e-12)


def test_best_split_is_sklearns_spectral_clustering_with_the_lowest_davies_bouldin():
    rng = np.random.default_rng(2)
    groups = np.repeat([0, 1, 2], 5)
    similarity = np.where(groups[:, None] == groups[None, :], 0.9, 0.05)
    similarity = similarity + 0.02 * rng.random((15, 15))
    similarity = (similarity + similarity.T) / 2
    np.fill_diagonal(similarity, 0.0)
    labels, index = best_split(similarity, 4, 1.0, seed=5)
    scores, found = {}, {}
    for k in (2, 3, 4):
        y = SpectralClustering(
            n_clusters=k,
            n_components=k,
            affinity="precomputed",
            assign_labels="cluster_qr",
            random_state=5,
        ).fit_predict(similarity)
        emb = SpectralEmbedding(
            n_components=k, affinity="precomputed", random_state=5
        ).fit_transform(similarity)
        scores[k], found[k] = davies_bouldin_score(emb, y), y
    best = min(scores, key=scores.get)
    assert index == scores[best]
    assert labels is not None and np.array_equal(labels, found[best])
    assert ari(groups, labels) > 0.5  # the index prefers k = 2 here: two groups merge
    assert best_split(similarity, 4, index, seed=5)[0] is None  # not below the bound


def unequal_rotations() -> Federation:
    """12 clients of upright digits and 4 of digits turned 180° (the last four): under
    one model the minority's losses stand out."""
    ds = load_dataset("digits")
    order = np.random.default_rng(0).permutation(len(ds.train.y))
    train, test, groups = [], [], []
    for c in range(16):
        g = int(c >= 12)
        idx = torch.as_tensor(order[c * 100 : (c + 1) * 100])
        x = torch.rot90(ds.train.x[idx], k=2 * g, dims=(2, 3))
        train.append((x[:80], ds.train.y[idx][:80]))
        test.append((x[80:], ds.train.y[idx][80:]))
        groups.append(g)
    return Federation.from_clients(train, test, 10, np.array(groups))


def half(rng: np.random.Generator) -> np.ndarray:
    return np.sort(rng.choice(16, 8, replace=False))


def test_fedgwc_first_split_separates_the_minority_group():
    """8 of 16 clients a round: once the interactions settle, the first split of all
    clients puts exactly the 4 rotated clients apart (seed 0: round 13)."""
    fed = unequal_rotations()
    ctx = make_context(fed, **SMALL_MLP)
    alg = FedGWC(FedGWC.Params(eps=1e-3), ctx)
    state = alg.init_state()
    rng = np.random.default_rng(0)
    for rnd in range(1, 41):
        ctx.channel.start_round()
        out = alg.run_round(state, rnd, half(rng))
        state = out.state
        if out.diagnostics["fedgwc/splits"]:
            break
    assert len(state.models) == 2
    assert ari(fed.groups, alg.clusters(state)) == 1.0
    assert out.diagnostics["fedgwc/davies_bouldin"] < 1.0


def test_fedgwc_never_splits_under_full_participation_and_counts_the_loss(rotations):
    """m = N: no cluster can hold twice its participants (the reference code's bound);
    each upload carries the model, the sample count and the loss."""
    ctx = make_context(rotations, **SMALL_MLP)
    alg = FedGWC(FedGWC.Params(eps=1.0, patience=1), ctx)
    state, out = run(alg, ctx, range(1, 4))
    assert len(state.models) == 1 and out.diagnostics["fedgwc/clusters"] == 1.0
    assert ctx.channel.traffic.up == 16 * (ctx.dim * FLOAT_BYTES + 2 * INT_BYTES)


def test_fedgwc_warns_when_all_clients_show_no_structure(caplog):
    """One group, half the clients a round, a loose ε: the examined root finds no split
    below the Davies-Bouldin bound and says so."""
    fed = rotated_digits(n_groups=1, clients_per_group=16, per_client=60)
    ctx = make_context(fed, **SMALL_MLP)
    alg = FedGWC(FedGWC.Params(eps=1e-2, max_davies_bouldin=0.05), ctx)
    with caplog.at_level(logging.WARNING, logger="fedcluster"):
        state, _ = run(alg, ctx, range(1, 31), selected=half)
    assert len(state.models) == 1
    assert any("no cluster structure" in r.message for r in caplog.records)


def test_fedgwc_warns_when_its_interactions_never_settle(caplog):
    """ε far below the mse's plateau: after 20 times a client's wait to be sampled
    (16 clients, 8 a round: 40 rounds) no cluster was examined, and FedGWC says so."""
    ctx = make_context(unequal_rotations(), **SMALL_MLP)
    alg = FedGWC(FedGWC.Params(eps=1e-12), ctx)
    with caplog.at_level(logging.WARNING, logger="fedcluster"):
        state, out = run(alg, ctx, range(1, 41), selected=half)
    assert len(state.models) == 1 and out.diagnostics["fedgwc/mse"] > 1e-12
    warned = [r for r in caplog.records if "have not settled" in r.message]
    assert len(warned) == 1 and "round 40" in warned[0].message


def test_clove_warns_once_when_the_silhouette_stays_below_its_bound(caplog):
    """One group of clients: the 4 groups k-means forms have a silhouette of 0.36-0.45
    in rounds 3-5 (seed 0), below the bound 0.5 given here: one warning, not one per
    round."""
    fed = rotated_digits(n_groups=1, clients_per_group=12, per_client=60)
    ctx = make_context(fed, **SMALL_MLP)
    alg = CLoVE(CLoVE.Params(n_clusters=4, warmup_rounds=2, warn_silhouette=0.5), ctx)
    with caplog.at_level(logging.WARNING, logger="fedcluster"):
        _, out = run(alg, ctx, range(1, 6))
    warned = [r for r in caplog.records if "no cluster structure" in r.message]
    assert len(warned) == 1 and out.diagnostics["clove/groups"] == 4.0
