"""FLUX (Fenoglio et al., NeurIPS 2025): the descriptor of a tiny client against a direct
numpy computation, DBSCAN and the adaptive radius on hand-made descriptors, and the
clustering of the quickstart's four rotation groups with label-free placement of
clients that arrive later."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from fedcluster.algorithms.flux import (
    FLUX,
    adaptive_eps,
    cluster_descriptors,
    dbscan,
    descriptor,
)
from fedcluster.clustering.validity import purity
from fedcluster.config.schema import resolve_config
from fedcluster.data.configured import build_federation_for
from fedcluster.errors import ConfigError
from tests.helpers import make_context


def test_descriptor_equals_its_moments_computed_directly():
    z = np.array([[1.0, 2.0], [3.0, -1.0], [0.5, 0.0], [2.0, 4.0]])
    y = np.array([0, 2, 0, 2])
    got = descriptor(torch.tensor(z), torch.tensor(y), n_classes=3).double().numpy()
    want = np.concatenate(
        [
            z.mean(axis=0),
            z.std(axis=0),
            [0.5, 0.0, 0.5],
            z[y == 0].mean(axis=0),
            [0.0, 0.0],  # the label the client lacks
            z[y == 2].mean(axis=0),
        ]
    )
    assert np.allclose(got, want, atol=1e-6)  # float32 rounding of values of order 1


def test_dbscan_on_hand_made_points():
    """Two tight pairs, a border point within reach of one core, an outlier."""
    points = np.array([[0.0], [0.1], [5.0], [5.1], [5.25], [20.0]])
    distances = np.abs(points - points.T)
    labels = dbscan(distances, eps=0.2, min_samples=2)
    assert labels.tolist() == [0, 0, 1, 1, 1, -1]
    assert (dbscan(distances, eps=0.01, min_samples=2) == -1).all()


def test_adaptive_radius_is_the_scaled_median_neighbour_distance():
    points = np.array([[0.0], [1.0], [3.0], [7.0]])
    distances = np.abs(points - points.T)
    # nearest-neighbour distances (self excluded): 1, 1, 2, 4 -> median 1.5
    assert adaptive_eps(distances, min_samples=1, scale=2.0) == pytest.approx(3.0)


def test_noise_joins_the_nearest_centroid_and_all_noise_is_one_cluster():
    points = np.array([[0.0, 0.0], [0.0, 0.2], [10.0, 0.0], [10.0, 0.2], [7.0, 0.0]])
    labels = cluster_descriptors(points, min_samples=2, eps_scale=1.5)
    assert labels[0] == labels[1] != labels[2] == labels[3] == labels[4]
    spread = np.array([[0.0], [10.0], [30.0]])
    assert cluster_descriptors(spread, min_samples=3, eps_scale=0.1).tolist() == [0, 0, 0]


@pytest.fixture(scope="module")
def quickstart():
    """The quickstart's federation: 24 clients of mnist5k in 4 rotation groups."""
    return build_federation_for(resolve_config(None, "quickstart", []), 0)


def test_flux_finds_the_four_rotation_groups_and_places_late_clients(quickstart):
    fed = quickstart
    ctx = make_context(fed, hidden=[16])
    alg = FLUX(FLUX.Params(pretrain_rounds=0), ctx)
    state = alg.init_state()
    late = np.array([0, 5, 11, 17])  # away at the clustering round
    available = np.ones(fed.n_clients, dtype=bool)
    available[late] = False
    ctx.channel.start_round(available=available)
    state = alg.run_round(state, 1, np.flatnonzero(available)[:0]).state
    labels = alg.clusters(state)
    assert (labels[late] == -1).all()
    assert len(state.models) == 4 and purity(fed.groups[available], labels[available]) == 1.0
    ctx.channel.start_round()
    state = alg.run_round(state, 2, late).state
    labels = alg.clusters(state)
    for c in late:  # each joined, label-free, the cluster of its own group
        peers = np.flatnonzero(fed.groups == fed.groups[c])
        assert (labels[peers] == labels[c]).all()


def test_flux_warns_when_it_finds_one_cluster(quickstart, caplog):
    fed = quickstart
    ctx = make_context(fed, hidden=[16])
    alg = FLUX(FLUX.Params(pretrain_rounds=0, eps_scale=100.0), ctx)
    ctx.channel.start_round()
    with caplog.at_level(logging.WARNING):
        state = alg.run_round(alg.init_state(), 1, np.arange(0)).state
    assert len(state.models) == 1
    assert "one cluster for all 24 clients" in caplog.text


def test_test_time_distances_are_those_of_the_uploaded_descriptor(quickstart):
    """A device holding a clustered client's training data, without labels: its
    distances to the clusters equal the client's uploaded marginal part's distances to
    the centroids, computed directly."""
    fed = quickstart
    ctx = make_context(fed, hidden=[16])
    alg = FLUX(FLUX.Params(pretrain_rounds=0), ctx)
    ctx.channel.start_round()
    state = alg.run_round(alg.init_state(), 1, np.arange(0)).state
    assert state.descriptors is not None and state.members is not None
    h = 16
    marginal = state.descriptors[:, : 2 * h]
    member_of = state.assign[state.members]
    centroids = np.stack([marginal[member_of == k].mean(axis=0) for k in range(4)])
    for row, client in enumerate(state.members[:3]):
        got = alg.descriptor_distances(state, fed.subset([int(client)]).x_train)
        want = np.linalg.norm(centroids - marginal[row], axis=1)
        assert got is not None and np.allclose(got, want, atol=1e-6)
        assert got.argmin() == state.assign[client]


def test_a_model_without_a_linear_head_is_one_line(quickstart):
    ctx = make_context(quickstart, hidden=[16])
    ctx.layout.module.append(torch.nn.ReLU())  # the classifier is no longer last
    with pytest.raises(ConfigError, match="must be an nn.Sequential ending in an nn.Linear"):
        FLUX(FLUX.Params(), ctx)
