"""FedAvg, FedProx, FedAvg+FT and local training on the algorithm interface."""

from __future__ import annotations

import numpy as np
import torch

from fedcluster.algorithms.base import weighted_loss
from fedcluster.algorithms.fedavg import FedAvg, FedAvgFT, FedProx, fedavg_step
from fedcluster.algorithms.local import LocalOnly
from fedcluster.engine.flat import weighted_average
from fedcluster.protocol.batches import LocalTraining
from tests.helpers import FLOAT_BYTES, INT_BYTES, make_context, rotated_digits


def test_fedavg_round_is_sample_weighted_average_of_local_models():
    fed = rotated_digits(n_groups=1, clients_per_group=4)
    ctx = make_context(fed, hidden=[16])
    alg = FedAvg(FedAvg.Params(), ctx)
    state = alg.init_state()
    selected = np.array([0, 2, 3])
    start = state.global_model.clone()
    out = alg.run_round(state, 1, selected)
    assert torch.equal(state.global_model, start)  # the state given stays as it was
    state = out.state
    trained = ctx.channel.backend.train(selected, start, ctx.train, 1)
    local = trained.rows
    expected = weighted_average(local, torch.as_tensor(fed.train_sizes[selected]))
    assert torch.allclose(state.global_model, expected)
    assert out.loss == weighted_loss(trained.loss, fed.train_sizes[selected])
    assert out.diagnostics == {}
    d = ctx.dim
    assert ctx.channel.traffic.down == 3 * d * FLOAT_BYTES
    assert ctx.channel.traffic.up == 3 * (d * FLOAT_BYTES + INT_BYTES)


def test_fedavg_step_is_one_fedavg_round_and_keeps_the_model_without_updates():
    """The shared step equals FedAvg's round; with no client it returns the model itself."""
    fed = rotated_digits(n_groups=1, clients_per_group=4)
    selected = np.array([1, 3])
    ctx, twin = make_context(fed, hidden=[16]), make_context(fed, hidden=[16])
    start = ctx.init_row.clone()
    model, ex = fedavg_step(ctx, start, 1, selected)
    fedavg = FedAvg(FedAvg.Params(), twin)
    out = fedavg.run_round(fedavg.init_state(), 1, selected)
    assert torch.equal(model, out.state.global_model)
    assert ex.clients.tolist() == [1, 3] and torch.equal(start, ctx.init_row)
    same, nobody = fedavg_step(ctx, start, 2, np.array([], dtype=np.int64))
    assert same is start and len(nobody.clients) == 0


def test_fedavg_learns_and_is_deterministic():
    fed = rotated_digits(n_groups=1, clients_per_group=6)
    accs = []
    for _ in range(2):
        ctx = make_context(fed, hidden=[32], train=LocalTraining(lr=0.1, batch_size=16, epochs=3))
        alg = FedAvg(FedAvg.Params(), ctx)
        state = alg.init_state()
        before = alg.evaluate(state, 0).correct.sum()
        for rnd in range(1, 11):
            state = alg.run_round(state, rnd, np.arange(fed.n_clients)).state
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
        state = alg.run_round(state, rnd, np.arange(fed.n_clients)).state
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
    state = alg.run_round(state, 1, np.array([1, 3])).state
    rows, which = alg.eval_rows(state)
    assert torch.equal(rows[0], ctx.init_row) and torch.equal(rows[2], ctx.init_row)
    assert not torch.equal(rows[1], ctx.init_row)
    assert list(which) == [0, 1, 2, 3]
    assert ctx.channel.traffic.up == ctx.channel.traffic.down == 0
