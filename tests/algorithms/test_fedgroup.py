"""FedGroup / FedGrouProx: group cold start (Alg. 3), client cold start (eq. 9), Alg. 2."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcluster.algorithms.base import Context, init_row
from fedcluster.algorithms.fedgroup import (
    PRETRAIN_PURPOSE,
    FedGroup,
    FedGrouProx,
    inter_group_aggregation,
)
from fedcluster.clustering.distances import edc_matrix, madc_matrix
from fedcluster.clustering.validity import ari
from fedcluster.data.federation import Federation
from fedcluster.engine.simulator import Simulator
from fedcluster.models import build_model
from fedcluster.protocol.batches import LocalTraining
from tests.helpers import FLOAT_BYTES, INT_BYTES

LABEL_GROUPS = ([0, 1, 2], [3, 4, 5], [6, 7, 8])
TRAIN = LocalTraining(lr=0.05, batch_size=10)


@pytest.fixture(scope="module")
def mnist(shared_dataset):
    return shared_dataset("mnist")


def label_federation(
    mnist, classes_of: list[list[int]], sizes: np.ndarray, groups: np.ndarray, seed: int
) -> Federation:
    """Client i holds ``sizes[i]`` real MNIST training images of the classes ``classes_of[i]``."""
    rng = np.random.default_rng(seed)
    y_train, y_test = mnist.train.y.numpy(), mnist.test.y.numpy()
    train, test = [], []
    for classes, size in zip(classes_of, sizes, strict=True):
        i_tr = rng.choice(np.flatnonzero(np.isin(y_train, classes)), size, replace=False)
        i_te = rng.choice(np.flatnonzero(np.isin(y_test, classes)), 20, replace=False)
        train.append((mnist.train.x[i_tr], mnist.train.y[i_tr]))
        test.append((mnist.test.x[i_te], mnist.test.y[i_te]))
    return Federation.from_clients(train, test, 10, groups)


@pytest.fixture(scope="module")
def label_groups(mnist) -> Federation:
    """30 clients in 3 groups (client i in group i mod 3) with disjoint label sets."""
    groups = np.arange(30) % 3
    classes = [LABEL_GROUPS[g] for g in groups]
    return label_federation(mnist, classes, np.full(30, 60), groups, seed=0)


def make(federation: Federation, cls: type[FedGroup] = FedGroup, seed: int = 0, **params):
    model = build_model("mclr", federation.input_shape, 10)
    sim = Simulator(model, federation, seed=seed)
    ctx = Context.for_backend(sim, TRAIN, seed, init_row(model, seed, "init"))
    return cls(cls.Params(**params), ctx)


def run(alg: FedGroup, rounds: int, per_round: int = 10) -> tuple[dict, list[float]]:
    """``rounds`` rounds with ``per_round`` clients drawn from (round) alone."""
    state, losses = alg.init_state(), []
    for rnd in range(1, rounds + 1):
        rng = np.random.default_rng(rnd)
        selected = np.sort(rng.choice(alg.ctx.n_clients, per_round, replace=False))
        out = alg.run_round(state, rnd, selected)
        state = out.state
        losses.append(out.loss)
    return state, losses


def test_edc_and_madc_agree_on_fedgroup_mnist(mnist):
    """Client i holds classes i mod 10 and (i+1) mod 10, power-law-like sizes (FedProx's MNIST).

    The α·m = 60 pre-training updates' EDC (m = 3) and MADC matrices are
    nearly linearly related (FedGroup Fig. 5): Pearson r >= 0.8.
    """
    n = 60
    rng = np.random.default_rng(5)
    sizes = np.clip(rng.lognormal(3.5, 0.7, n).astype(int), 10, 300)
    classes = [[i % 10, (i + 1) % 10] for i in range(n)]
    federation = label_federation(mnist, classes, sizes, np.arange(n) % 10, seed=5)
    alg = make(federation, n_groups=3)
    updates = alg.pretrain(np.arange(n)).rows
    upper = np.triu_indices(n, 1)
    edc = edc_matrix(updates, 3).numpy()[upper]
    madc = madc_matrix(updates).numpy()[upper]
    assert np.corrcoef(edc, madc)[0, 1] >= 0.8


@pytest.mark.parametrize("measure", ["edc", "madc"])
@pytest.mark.parametrize("cls", [FedGroup, FedGrouProx])
def test_recovers_label_groups(label_groups, measure, cls):
    alg = make(label_groups, cls, n_groups=3, pretrain_scale=4, measure=measure)
    state, losses = run(alg, 5)
    assigned = state.assign >= 0
    assert assigned.sum() > 12  # the 12 pre-training clients and cold clients selected since
    assert ari(label_groups.groups[assigned], state.assign[assigned]) == 1.0
    assert all(np.isfinite(losses))
    assert alg.evaluate(state, 5).accuracy.mean() > 0.8


def test_group_cold_start_bytes_and_groups(label_groups):
    alg = make(label_groups, n_groups=3, pretrain_scale=4)
    state = alg.init_state()
    state = alg.group_cold_start(state)
    dim = alg.ctx.dim
    pretrained = np.flatnonzero(state.assign >= 0)
    assert len(pretrained) == 12
    assert (
        alg.ctx.channel.traffic.down == alg.ctx.channel.traffic.up == 12 * dim * FLOAT_BYTES
    )  # w0 down, update up
    # Group models are their members' average models; directions = model − w0 (Alg. 3 l. 16-17).
    w0 = alg.ctx.init_row
    updates = alg.pretrain(pretrained).rows
    for g in range(3):
        members = state.assign[pretrained] == g
        expected = w0 + updates[torch.as_tensor(members)].mean(dim=0)
        assert torch.allclose(state.models[g], expected, atol=1e-6)
    assert torch.allclose(state.directions, state.models - w0)


def test_client_cold_start_picks_the_largest_cosine(label_groups):
    alg = make(label_groups, n_groups=3, pretrain_scale=4)
    state = alg.init_state()
    state = alg.group_cold_start(state)
    cold = int(np.flatnonzero(state.assign < 0)[0])

    # By hand: pre-train one epoch from w0 and compare directions by cosine (eq. 9).
    w0 = alg.ctx.init_row
    cfg = LocalTraining(lr=TRAIN.lr, batch_size=TRAIN.batch_size, epochs=1)
    update = (
        alg.ctx.channel.backend.train(np.array([cold]), w0, cfg, 0, purpose=PRETRAIN_PURPOSE).rows[
            0
        ]
        - w0
    )
    u = update.double()
    cosines = [float(u @ d.double() / (u.norm() * d.double().norm())) for d in state.directions]
    dissimilarity = [(1.0 - c) / 2.0 for c in cosines]

    alg.ctx.channel.traffic.down = alg.ctx.channel.traffic.up = 0
    state = alg.run_round(state, 1, np.array([cold])).state
    assert state.assign[cold] == int(np.argmin(dissimilarity)) == int(np.argmax(cosines))
    mates = (label_groups.groups == label_groups.groups[cold]) & (state.assign >= 0)
    assert (state.assign[mates] == state.assign[cold]).all()  # and it is the right group
    dim = alg.ctx.dim
    assert (
        alg.ctx.channel.traffic.down == 2 * dim * FLOAT_BYTES
    )  # w0 for pre-training, then its group model
    assert (
        alg.ctx.channel.traffic.up == 2 * dim * FLOAT_BYTES + INT_BYTES
    )  # update, then model + size


def test_rcc_uses_m_random_centres(label_groups):
    alg = make(label_groups, n_groups=3, rcc=True)
    state = alg.init_state()
    state = alg.group_cold_start(state)
    centres = np.flatnonzero(state.assign >= 0)
    assert len(centres) == 3 and sorted(state.assign[centres]) == [0, 1, 2]
    assert torch.allclose(state.directions, alg.pretrain(centres).rows[state.assign[centres]])
    state, losses = run(alg, 3)
    assert all(np.isfinite(losses))


def test_rac_assigns_cold_clients_without_pretraining(label_groups):
    alg = make(label_groups, n_groups=3, pretrain_scale=4, rac=True)
    state = alg.init_state()
    state = alg.group_cold_start(state)
    cold = np.flatnonzero(state.assign < 0)[:8]
    alg.ctx.channel.traffic.down = alg.ctx.channel.traffic.up = 0
    state = alg.run_round(state, 1, cold).state
    assert (state.assign[cold] >= 0).all()
    assert alg.ctx.channel.traffic.down == len(cold) * alg.ctx.dim * FLOAT_BYTES  # no pre-training


def test_fedgrouprox_defaults_and_proximal_term(label_groups):
    assert FedGroup.Params().mu == 0.0 and FedGrouProx.Params().mu == 1.0
    assert FedGroup.Params().pretrain_scale == 20 and FedGroup.Params().eta_g == 0.0
    plain, _ = run(make(label_groups, FedGroup, n_groups=3, pretrain_scale=4), 2)
    prox, _ = run(make(label_groups, FedGrouProx, n_groups=3, pretrain_scale=4), 2)
    assert np.array_equal(plain.assign, prox.assign)
    assert not torch.equal(plain.models, prox.models)


def test_inter_group_aggregation(label_groups):
    models = torch.tensor([[3.0, 4.0], [0.0, 2.0]])
    eta = 0.5
    out = inter_group_aggregation(models, eta)
    expected0 = (models[0] + eta * models[1] / 2.0) / (1.0 + eta / 2.0)
    expected1 = (models[1] + eta * models[0] / 5.0) / (1.0 + eta / 5.0)
    assert torch.allclose(out, torch.stack([expected0, expected1]))
    state, losses = run(make(label_groups, n_groups=3, pretrain_scale=4, eta_g=0.1), 2)
    assert all(np.isfinite(losses)) and state.grouped


def test_same_seed_same_numbers(label_groups):
    first, losses = run(make(label_groups, seed=2, n_groups=3, pretrain_scale=4), 3)
    second, losses_again = run(make(label_groups, seed=2, n_groups=3, pretrain_scale=4), 3)
    assert losses == losses_again
    assert torch.equal(first.models, second.models)
    assert np.array_equal(first.assign, second.assign)
