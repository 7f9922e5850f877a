"""IFCA's weight sharing (Ghosh et al. 2020, Sec. 5), for IFCA and JGL: ``shared_layers``.

The K cluster models share the named layers: after each round those equal the
(weighted) average over every accepted client, the other layers the average
within each cluster; the broadcast of the K models sends the shared layers once.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcluster.algorithms.base import algorithm_params
from fedcluster.algorithms.ifca import IFCA
from fedcluster.algorithms.jgl import JGL
from fedcluster.algorithms.repair import ClusterRepair
from fedcluster.clustering.validity import purity
from fedcluster.config.schema import AlgorithmSpec
from fedcluster.data.federation import Federation
from fedcluster.data.sources import load_dataset
from fedcluster.errors import ConfigError
from fedcluster.protocol.batches import LocalTraining
from tests.helpers import FLOAT_BYTES, make_context, rotated_digits

HIDDEN = 8
SHARED = 64 * HIDDEN + HIDDEN  # the 64-8-10 MLP's first layer (weight, bias): all but the last
DIM = SHARED + HIDDEN * 10 + 10


def _digits(sizes: list[int]) -> Federation:
    """Clients of scikit-learn's digits with ``sizes`` training and 10 test samples each."""
    ds = load_dataset("digits")
    train, test, start = [], [], 0
    for s in sizes:
        x, y = ds.train.x[start : start + s + 10], ds.train.y[start : start + s + 10]
        train.append((x[:s], y[:s]))
        test.append((x[s:], y[s:]))
        start += s + 10
    return Federation.from_clients(train, test, 10)


def _mean(rows: torch.Tensor, weights: np.ndarray) -> torch.Tensor:
    """Weighted mean of rows [n, m], in float64, written out."""
    w = torch.as_tensor(weights, dtype=torch.float64)
    return (w[:, None] * rows.double()).sum(dim=0) / w.sum()


@pytest.mark.parametrize(
    "cls,params",
    [
        (IFCA, {"weighting": "samples"}),
        (JGL, {"weighting": "uniform"}),
        (JGL, {"weighting": "samples", "choice_on_device": True}),
    ],
)
def test_shared_slice_is_the_global_average_and_the_rest_the_cluster_average(cls, params):
    fed = _digits([20, 55, 31, 48, 26, 40])
    ctx = make_context(fed, hidden=[HIDDEN])
    assert ctx.dim == DIM
    alg = cls(cls.Params(n_clusters=3, shared_layers="all_but_last", **params), ctx)
    state = alg.init_state()
    start = state.models.clone()
    assert torch.equal(start[:, :SHARED], start[:1, :SHARED].expand(3, -1))  # tied from the start
    clients = np.arange(fed.n_clients)
    state = alg.run_round(state, 1, clients).state
    choice = state.assign
    assert len(np.unique(choice)) >= 2  # otherwise global and cluster averages coincide
    # The clients' trained rows, recomputed from the models they chose.
    rows = ctx.channel.backend.train(clients, start[choice], ctx.train, 1).rows
    sizes = fed.train_sizes if params["weighting"] == "samples" else np.ones(len(clients))
    shared = _mean(rows[:, :SHARED], sizes)
    for k in range(3):
        assert torch.allclose(state.models[k, :SHARED].double(), shared, atol=1e-6)
        members = choice == k
        own = _mean(rows[members, SHARED:], sizes[members]) if members.any() else start[k, SHARED:]
        assert torch.allclose(state.models[k, SHARED:].double(), own.double(), atol=1e-6)


@pytest.mark.parametrize(
    "cls,params,tied_tensors",
    [
        (IFCA, {}, 1),  # the K models of the loss query
        (IFCA, {"choice_on_device": True}, 1),
        (JGL, {}, 2),  # the K models and their K updates Δw_k
    ],
)
def test_the_k_models_travel_with_their_shared_layers_once(cls, params, tied_tensors):
    fed = rotated_digits(n_groups=2, clients_per_group=2)
    traffic = {}
    for shared in (None, "all_but_last"):
        ctx = make_context(fed, hidden=[HIDDEN])
        alg = cls(cls.Params(n_clusters=3, shared_layers=shared, **params), ctx)
        state = alg.init_state()
        for rnd in (1, 2):
            state = alg.run_round(state, rnd, np.arange(4)).state
        traffic[shared] = ctx.channel.traffic
    saved = 2 * 4 * tied_tensors * (3 - 1) * SHARED * FLOAT_BYTES  # rounds × clients × ...
    assert traffic[None].down - traffic["all_but_last"].down == saved
    assert traffic[None].up == traffic["all_but_last"].up  # each client uploads its whole model


def test_a_list_of_names_shares_those_layers():
    fed = _digits([20, 35, 28, 40])
    ctx = make_context(fed, hidden=[HIDDEN])
    alg = IFCA(IFCA.Params(n_clusters=2, shared_layers=["1.bias", "3.bias"]), ctx)
    state = alg.init_state()
    state = alg.run_round(state, 1, np.arange(4)).state
    biases = [slice(512, 520), slice(600, 610)]
    for cols in biases:
        assert torch.equal(state.models[0, cols], state.models[1, cols])
    assert not torch.equal(state.models[0, :512], state.models[1, :512])


@pytest.mark.parametrize(
    "value,says",
    [
        (["1.weight", "fc9.bias"], "unknown parameter 'fc9.bias'"),
        (["1.weight", "1.bias", "3.weight", "3.bias"], "shares every parameter"),
        ([], "an empty list shares nothing"),
        ("all_but_first", "'all_but_first' is neither"),
    ],
)
def test_bad_shared_layers_get_a_one_line_error_naming_the_value(value, says):
    ctx = make_context(rotated_digits(n_groups=2, clients_per_group=1), hidden=[HIDDEN])
    with pytest.raises(ConfigError) as err:
        spec = AlgorithmSpec(name="ifca", params={"shared_layers": value})
        IFCA(algorithm_params(spec), ctx)
    message = str(err.value)
    assert "shared_layers" in message and says in message and "\n" not in message


def test_ifca_with_shared_layers_and_repair_finds_four_rotation_groups():
    """All layers but the last shared (IFCA's CIFAR setting) on four rotation groups.

    Alone, the shared variant leaves clusters unchosen (the quickstart ends with
    two clusters, docs/clustering.md); with cluster repair it finds the groups.
    """
    fed = rotated_digits(n_groups=4, clients_per_group=4, per_client=150, dataset="mnist5k")
    ctx = make_context(fed, hidden=[64], train=LocalTraining(lr=0.1, batch_size=32, epochs=1))
    params = IFCA.Params(n_clusters=4, shared_layers="all_but_last", repair=ClusterRepair())
    alg = IFCA(params, ctx)
    state = alg.init_state()
    for rnd in range(1, 11):
        state = alg.run_round(state, rnd, np.arange(fed.n_clients)).state
    assert purity(fed.groups, alg.clusters(state)) == 1.0
    assert torch.equal(state.models[:, :-650], state.models[:1, :-650].expand(4, -1))
