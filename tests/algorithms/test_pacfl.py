"""PACFL (Vahidian et al., AAAI 2023): principal angles against scipy and a hand
computation, the client's subspace against numpy's SVD, and the one-shot clustering of
the quickstart's four rotation groups before any training."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import scipy.linalg
import torch

from fedcluster.algorithms.pacfl import (
    PACFL,
    data_subspace,
    orthonormal_bases,
    principal_angles,
    proximity_matrix,
)
from fedcluster.clustering.validity import purity
from fedcluster.config.schema import resolve_config, validate_config
from fedcluster.data.configured import build_federation_for
from fedcluster.errors import ConfigError
from fedcluster.experiment.runner import Experiment
from tests.helpers import FLOAT_BYTES, make_context, rotated_mnist5k


def test_principal_angles_of_known_subspaces():
    """span{e1, e2} and span{e1, cos t e2 + sin t e3}: angles 0 and t; span{e4}: π/2."""
    t = 0.3
    a = torch.zeros(1, 5, 2, dtype=torch.float64)
    a[0, 0, 0] = a[0, 1, 1] = 1.0
    b = torch.zeros(2, 5, 2, dtype=torch.float64)
    b[0, 0, 0] = 1.0
    b[0, 1, 1], b[0, 2, 1] = math.cos(t), math.sin(t)
    b[1, 3, 0] = 1.0  # rank 1, second column padding
    angles = principal_angles(a, b)
    assert torch.allclose(angles[0, 0], torch.tensor([0.0, t], dtype=torch.float64), atol=1e-7)
    assert torch.allclose(angles[0, 1, 0], torch.tensor(math.pi / 2, dtype=torch.float64))


def test_proximity_equals_scipy_subspace_angles_on_random_spans():
    rng = np.random.default_rng(0)
    spans = [rng.normal(size=(12, r)) for r in (3, 2, 4, 3)]  # different ranks
    width = max(s.shape[1] for s in spans)
    padded = torch.stack(
        [torch.as_tensor(np.pad(s, ((0, 0), (0, width - s.shape[1])))) for s in spans]
    )
    q, ranks = orthonormal_bases(padded)
    assert ranks.tolist() == [3, 2, 4, 3]
    smallest = proximity_matrix(q, ranks, q, ranks, "smallest")
    summed = proximity_matrix(q, ranks, q, ranks, "sum")
    for i, si in enumerate(spans):
        for j, sj in enumerate(spans):
            ref = np.rad2deg(scipy.linalg.subspace_angles(si, sj))  # descending
            assert smallest[i, j] == pytest.approx(ref.min(), abs=1e-5)
            assert summed[i, j] == pytest.approx(ref.sum(), abs=1e-5)


def test_client_subspace_is_the_svd_of_each_labels_data():
    """Per label, the basis spans the top-p left singular vectors of that label's Xᵀ
    (compared as projectors: the signs of singular vectors are arbitrary); a label
    the client lacks is zero columns."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(30, 1, 3, 3, generator=gen)
    y = torch.tensor([0] * 12 + [2] * 18)
    basis = data_subspace(x, y, n_basis=2, n_classes=3).double()
    assert basis.shape == (9, 6)
    for c, cols in ((0, slice(0, 2)), (2, slice(4, 6))):
        u = np.linalg.svd(x[y == c].reshape(-1, 9).double().numpy().T)[0][:, :2]
        got = basis[:, cols].numpy()
        assert np.allclose(got @ got.T, u @ u.T, atol=1e-5)
    assert torch.count_nonzero(basis[:, 2:4]) == 0
    whole = data_subspace(x, y, n_basis=2, n_classes=None).double().numpy()
    u = np.linalg.svd(x.reshape(-1, 9).double().numpy().T)[0][:, :2]
    assert np.allclose(whole @ whole.T, u @ u.T, atol=1e-5)


@pytest.fixture(scope="module")
def quickstart():
    """The quickstart's federation: 24 clients of mnist5k in 4 rotation groups."""
    return build_federation_for(resolve_config(None, "quickstart", []), 0)


def test_pacfl_places_the_four_rotation_groups_before_training(quickstart):
    fed = quickstart
    ctx = make_context(fed, hidden=[16])
    alg = PACFL(PACFL.Params(), ctx)
    state = alg.init_state()
    everyone = np.arange(fed.n_clients)
    ctx.channel.start_round()
    state = alg.run_round(state, 1, everyone[:0]).state  # nobody trains: the clustering alone
    labels = alg.clusters(state)
    assert len(state.models) == 4 and purity(fed.groups, labels) == 1.0
    p, c = PACFL.Params().n_basis, fed.n_classes
    assert ctx.channel.traffic.up == fed.n_clients * 784 * p * c * FLOAT_BYTES
    assert ctx.channel.traffic.down == 0  # the server sends no tensor, only settings


def test_pacfl_places_a_newcomer_by_the_same_angles(quickstart):
    fed = quickstart
    ctx = make_context(fed, hidden=[16])
    alg = PACFL(PACFL.Params(), ctx)
    state = alg.init_state()
    late = np.array([0, 5, 11, 17])  # one client of each group is away at the clustering
    available = np.ones(fed.n_clients, dtype=bool)
    available[late] = False
    ctx.channel.start_round(available=available)
    state = alg.run_round(state, 1, np.flatnonzero(available)).state
    assert (alg.clusters(state)[late] == -1).all()
    ctx.channel.start_round()
    state = alg.run_round(state, 2, late).state
    labels = alg.clusters(state)
    assert purity(fed.groups, labels) == 1.0
    for c in late:  # each joined a cluster of its own group's clients
        peers = np.flatnonzero(fed.groups == fed.groups[c])
        assert (labels[peers] == labels[c]).all()


def test_pacfl_subspace_is_released_under_client_level_local_dp(tmp_path):
    """The subspace is a statistic of the raw data: released (a ledger entry per client
    in the clustering round), and refused at record level (no per-sample sensitivity)."""
    config = {
        "name": "pacfl-dp",
        "seeds": [0],
        "rounds": 1,
        "data": rotated_mnist5k(6),
        "model": {"name": "mlp", "options": {"hidden": [16]}},
        "algorithms": [{"name": "pacfl"}],
    }
    client = {**config, "privacy": {"mode": "client", "epsilon": 5.0, "max_participations": 2}}
    Experiment(validate_config(client)).run(tmp_path / "client", progress=False)
    with open(tmp_path / "client/metrics.csv", newline="") as f:
        (row,) = csv.DictReader(f)
    assert float(row["epsilon"]) > 0 and int(row["bytes_up"]) > 0
    record = {**config, "privacy": {"mode": "record", "epsilon": 5.0, "max_participations": 1}}
    with pytest.raises(ConfigError, match="cannot release the pacfl-subspace upload"):
        Experiment(validate_config(record)).run(tmp_path / "record", progress=False)
