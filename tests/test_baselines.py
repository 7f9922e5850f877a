"""FedAvg, FedProx, FedAvg+FT and local training on the algorithm interface."""

from __future__ import annotations

import numpy as np
import torch

from fedcluster.algorithms.fedavg import FedAvg, FedAvgFT, FedProx
from fedcluster.algorithms.local import LocalOnly
from fedcluster.engine.batches import LocalTraining
from fedcluster.engine.flat import weighted_average
from tests.helpers import FLOAT_BYTES, INT_BYTES, make_context, rotated_digits


def test_fedavg_round_is_sample_weighted_average_of_local_models():
    fed = rotated_digits(n_groups=1, clients_per_group=4)
    ctx = make_context(fed, hidden=[16])
    alg = FedAvg(FedAvg.Params(), ctx)
    state = alg.init_state()
    selected = np.array([0, 2, 3])
    start = state.global_model.clone()
    alg.run_round(state, 1, selected)
    local = ctx.channel.backend.train(selected, start, ctx.train, 1).rows
    expected = weighted_average(local, torch.as_tensor(fed.train_sizes[selected]))
    assert torch.allclose(state.global_model, expected)
    d = ctx.dim
    assert ctx.channel.traffic.down == 3 * d * FLOAT_BYTES
    assert ctx.channel.traffic.up == 3 * (d * FLOAT_BYTES + INT_BYTES)


def test_fedavg_learns_and_is_deterministic():
    fed = rotated_digits(n_groups=1, clients_per_group=6)
    accs = []
    for _ in range(2):
        ctx = make_context(fed, hidden=[32], train=LocalTraining(lr=0.1, batch_size=16, epochs=3))
        alg = FedAvg(FedAvg.Params(), ctx)
        state = alg.init_state()
        before = alg.evaluate(state, 0).correct.sum()
        for rnd in range(1, 11):
            alg.run_round(state, rnd, np.arange(fed.n_clients))
        res = alg.evaluate(state, 10)
        accs.append(res.correct.sum() / res.count.sum())
        assert res.correct.sum() > before
    assert accs[0] == accs[1] and accs[0] > 0.8


def test_fedprox_pulls_towards_the_global_model():
    fed = rotated_digits(n_groups=4, clients_per_group=2)
    drift = {}
    for name, alg_cls, params in (
        ("fedavg", FedAvg, FedAvg.Params()),
        ("fedprox", FedProx, FedProx.Params(mu=5.0)),
    ):
        ctx = make_context(fed, hidden=[16])
        start = ctx.init_row
        rows = ctx.channel.backend.train(
            np.arange(8), start, ctx.local(mu=params.mu, epochs=3), 1
        ).rows
        drift[name] = (rows - start).norm(dim=1).mean().item()
        assert alg_cls(params, ctx).init_state().global_model.shape == start.shape
    assert drift["fedprox"] < drift["fedavg"]


def test_fedavg_ft_personalises_only_the_classifier_and_sends_nothing_extra():
    fed = rotated_digits(n_groups=4, clients_per_group=2)
    ctx = make_context(fed, hidden=[32])
    alg = FedAvgFT(FedAvgFT.Params(ft_epochs=3), ctx)
    state = alg.init_state()
    for rnd in range(1, 4):
        alg.run_round(state, rnd, np.arange(fed.n_clients))
    plain = FedAvg.evaluate(alg, state, 3)
    ctx.channel.traffic.up = ctx.channel.traffic.down = 0
    tuned = alg.evaluate(state, 3)
    assert ctx.channel.traffic.up == ctx.channel.traffic.down == 0
    assert tuned.correct.sum() > plain.correct.sum()


def test_local_training_keeps_one_model_per_client_and_communicates_nothing():
    fed = rotated_digits(n_groups=2, clients_per_group=2)
    ctx = make_context(fed, hidden=[16])
    alg = LocalOnly(LocalOnly.Params(), ctx)
    state = alg.init_state()
    alg.run_round(state, 1, np.array([1, 3]))
    rows, which = alg.eval_rows(state)
    assert torch.equal(rows[0], ctx.init_row) and torch.equal(rows[2], ctx.init_row)
    assert not torch.equal(rows[1], ctx.init_row)
    assert list(which) == [0, 1, 2, 3]
    assert ctx.channel.traffic.up == ctx.channel.traffic.down == 0
