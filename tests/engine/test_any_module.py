"""Any ``nn.Module``, correctly: modes, Dropout's seeded masks,
BatchNorm statistics that travel (or stay, FedBN), and a user loss everywhere.

Every expected value is computed independently: a manual ``eval()`` pass of a
plain module, the plain per-client loop of :mod:`fedcluster.engine.reference`,
a hand-written label-smoothed cross-entropy.
"""

from __future__ import annotations

import copy
import csv

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedcluster.algorithms import ALGORITHMS, Context
from fedcluster.algorithms.base import init_row
from fedcluster.config.schema import validate_config
from fedcluster.engine.flat import ParamLayout
from fedcluster.engine.modes import resolve_loss
from fedcluster.engine.reference import reference_train
from fedcluster.engine.simulator import Simulator
from fedcluster.errors import ConfigError
from fedcluster.experiment.runner import Experiment
from fedcluster.models import build_model
from fedcluster.privacy.mechanisms import RecordDP
from fedcluster.protocol.batches import LocalTraining, batch_plan
from tests.helpers import (
    FLOAT32_EPS,
    FLOAT_BYTES,
    INT_BYTES,
    assert_same_run,
    assert_same_training,
    digits_config,
    evaluation_bounds,
    rotated_digits,
)

CFG = LocalTraining(lr=0.05, batch_size=16)
STEPS = -(-48 // CFG.batch_size)  # one epoch of a client's 48 samples (the fixture's)


def smoothed(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Label-smoothed cross-entropy (ε = 0.2), written out: (1 − ε)·NLL + ε·mean(−log p)."""
    logp = logits.log_softmax(dim=1)
    nll = -logp.gather(1, y.view(-1, 1)).squeeze(1)
    return (0.8 * nll - 0.2 * logp.mean(dim=1)).mean()


@pytest.fixture(scope="module")
def fed():
    return rotated_digits(n_groups=2, clients_per_group=2, per_client=48)


def _manual_eval(model, row, fed, loss=F.cross_entropy):
    """Correct predictions and summed loss per client by a plain ``eval()`` pass."""
    net = copy.deepcopy(model)
    ParamLayout(model).load_into(net, row)
    net.eval()
    correct, loss_sum = [], []
    with torch.no_grad():
        for c in range(fed.n_clients):
            sl = fed.client_slice(c, "test")
            logits = net(fed.x_test[sl])
            correct.append(int((logits.argmax(1) == fed.y_test[sl]).sum()))
            loss_sum.append(float(loss(logits, fed.y_test[sl])) * len(fed.y_test[sl]))
    return np.array(correct), np.array(loss_sum)


def test_dropout_model_evaluates_deterministically_as_a_manual_eval_pass(fed):
    model = build_model("cnn", fed.input_shape, 10, dropout=0.5)
    sim = Simulator(model, fed, seed=0)
    row = sim.train(np.arange(4), init_row(model, 0, "init"), CFG, 1).rows.mean(dim=0)
    everyone = np.arange(fed.n_clients)
    first = sim.evaluate(everyone, row.unsqueeze(0), np.zeros(fed.n_clients))
    again = sim.evaluate(everyone, row.unsqueeze(0), np.zeros(fed.n_clients))
    correct, loss_sum = _manual_eval(model, row, fed)
    np.testing.assert_array_equal(first.correct, again.correct)
    np.testing.assert_array_equal(first.loss_sum, again.loss_sum)
    # the manual pass sums in other orders (a float32 mean per client, times its size)
    loss_tol, undecided = evaluation_bounds(fed, model, row.unsqueeze(0))
    sizes = np.diff(fed.test_offsets)
    mean_rounding = 2 * sizes * FLOAT32_EPS * loss_sum
    assert np.all(np.abs(first.correct - correct) <= undecided[:, 0])
    assert np.all(np.abs(first.loss_sum - loss_sum) <= 2 * loss_tol[:, 0] + mean_rounding)


def test_dropout_training_draws_the_clients_derived_masks(fed):
    """Same seed, same rows (also on worker threads); the plain loop with the same
    derived masks agrees; another seed draws other masks from the same start."""
    model = build_model("cnn", fed.input_shape, 10, dropout=0.5)
    start = init_row(model, 0, "init")
    clients = np.arange(4)
    a = Simulator(model, fed, seed=0, threads=1).train(clients, start, CFG, 1).rows
    b = Simulator(copy.deepcopy(model), fed, seed=0, threads=2).train(clients, start, CFG, 1).rows
    ref = reference_train(model, fed, clients, start, CFG, seed=0, rnd=1)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert_same_training(model, fed.input_shape, CFG, STEPS, a, ref)
    # the batches are seed 0's in both: only the masks differ between these two
    plain = Simulator(build_model("cnn", fed.input_shape, 10), fed, seed=0)
    no_dropout = plain.train(clients, start, CFG, 1).rows
    assert (a - no_dropout).abs().max() > 1e-3


def test_two_runs_of_a_dropout_model_with_one_seed_give_identical_metrics(tmp_path):
    config = digits_config("dropout", rounds=2, algorithms=[{"name": "fedavg"}])
    config["model"] = {"name": "cnn", "options": {"dropout": 0.5}}
    config["data"]["partition"]["n_clients"] = 3
    for out in ("a", "b"):
        Experiment(validate_config(config)).run(tmp_path / out, progress=False)
    assert_same_run(tmp_path / "a", tmp_path / "b")


def _bn_model(fed):
    return build_model("fedcluster.models:resnet8", fed.input_shape, 10, width=4)


def test_batchnorm_statistics_are_averaged_like_the_parameters_after_one_fedavg_round(fed):
    model = _bn_model(fed)
    layout = ParamLayout(model)
    assert layout.dim > layout.param_dim  # running means and variances travel in the row
    sim = Simulator(model, fed, seed=0)
    ctx = Context.for_backend(sim, CFG, 0, init_row(model, 0, "init"))
    fedavg = ALGORITHMS["fedavg"](ALGORITHMS["fedavg"].Params(), ctx)
    state = fedavg.init_state()
    clients = np.arange(fed.n_clients)
    state = fedavg.run_round(state, 1, clients).state
    own = reference_train(model, fed, clients, ctx.init_row, CFG, seed=0, rnd=1)
    sizes = torch.as_tensor(fed.train_sizes, dtype=torch.float32)
    expected = (sizes / sizes.sum()) @ own
    stats = slice(layout.param_dim, layout.dim)
    assert not torch.allclose(own[0, stats], own[1, stats])  # clients' statistics differ
    torch.testing.assert_close(state.global_model[stats], expected[stats], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state.global_model, expected, rtol=1e-4, atol=1e-5)
    # bytes: each client receives and sends the whole row, statistics included
    traffic = ctx.channel.traffic
    assert traffic.down == fed.n_clients * layout.dim * FLOAT_BYTES
    assert traffic.up == fed.n_clients * (layout.dim * FLOAT_BYTES + INT_BYTES)


def test_fedbn_keeps_each_clients_batchnorm_layers(fed):
    """FedBN (``model.buffers: local``): after training, each client evaluates and trains
    with its own BatchNorm statistics and affine parameters in the received model."""
    model = _bn_model(fed)
    layout = ParamLayout(model)
    local = torch.cat([torch.arange(s.start, s.stop) for s in layout.local_slots()])
    assert local.max() >= layout.param_dim and local.min() < layout.param_dim  # stats, affine
    sim = Simulator(model, fed, seed=0, local_buffers=True)
    clients = np.arange(fed.n_clients)
    start = init_row(model, 0, "init")
    trained = sim.train(clients, start, CFG, 1).rows
    shared = trained.mean(dim=0)
    for c in clients:  # each client's own layers replace the shared ones
        mine = shared.clone()
        mine[local] = trained[c, local]
        res = sim.evaluate(np.array([c]), shared.unsqueeze(0), np.zeros(1))
        correct, loss_sum = _manual_eval(model, mine, fed)
        assert res.correct[0] == correct[c]
        np.testing.assert_allclose(res.loss_sum[0], loss_sum[c], rtol=1e-5)
    again = sim.train(clients, shared, CFG, 2).rows
    starts = shared.repeat(len(clients), 1)
    starts[:, local] = trained[:, local]
    ref = reference_train(model, fed, clients, starts, CFG, seed=0, rnd=2)
    assert_same_training(model, fed.input_shape, CFG, STEPS, again, ref)


def test_fedbn_from_the_config_gives_each_client_its_own_layers(tmp_path):
    config = digits_config("fedbn", rounds=1, algorithms=[{"name": "fedavg"}])
    config["model"] = {"name": "fedcluster.models:resnet8", "options": {"width": 4}}
    for buffers in ("federated", "local"):
        config["model"]["buffers"] = buffers
        experiment = Experiment(validate_config(config))
        experiment.run(tmp_path / buffers, progress=False)
    fed = experiment.federation(0)
    sim = experiment.backend_factory.backend(experiment.model(fed), fed, 0)
    assert isinstance(sim, Simulator) and sim.keeps_own_layers
    losses = []
    for buffers in ("federated", "local"):
        with open(tmp_path / buffers / "metrics.csv", newline="") as f:
            losses.append([float(r["test_loss"]) for r in csv.DictReader(f)])
    assert losses[0] != losses[1]  # the same training, evaluated with other BatchNorm layers


def test_a_user_loss_reaches_training_dp_sgd_and_the_cluster_choice(fed):
    model = build_model("mlp", fed.input_shape, 10, hidden=[16])
    start = init_row(model, 0, "init")
    clients = np.arange(fed.n_clients)
    ce = Simulator(model, fed, seed=0)
    sim = Simulator(model, fed, seed=0, loss=resolve_loss("tests.engine.test_any_module:smoothed"))
    assert ce.kernel is not None and sim.kernel is None  # the kernel's gradients are CE's

    # training: equal to the plain loop with the same loss, unlike cross-entropy
    rows = sim.train(clients, start, CFG, 1).rows
    ref = reference_train(model, fed, clients, start, CFG, 0, 1, loss_fn=smoothed)
    assert_same_training(model, fed.input_shape, CFG, STEPS, rows, ref)
    assert (rows - ce.train(clients, start, CFG, 1).rows).abs().max() > 1e-4

    # DP-SGD with σ = 0, a huge clip and fixed batches is plain SGD with that loss
    dp = LocalTraining(lr=CFG.lr, batch_size=CFG.batch_size, dp=RecordDP(1e6, 0.0, False))
    assert_same_training(
        model, fed.input_shape, dp, STEPS, sim.train(clients, start, dp, 1).rows, rows
    )

    # IFCA's choice: the loss of each model on the client's decision batch
    models = torch.stack([start, rows[0]])
    losses, _ = sim.losses_and_grads(clients, models, CFG, 1, with_grads=False)
    layout = ParamLayout(model)
    for c in clients:
        idx = batch_plan(int(fed.train_sizes[c]), CFG, 0, "decide", 1, int(c))[0]
        x, y = fed.x_train[fed.client_slice(c)][idx], fed.y_train[fed.client_slice(c)][idx]
        for j in range(2):
            expected = smoothed(layout.forward(models[j], x), y)
            torch.testing.assert_close(losses[c, j], expected.detach(), rtol=1e-5, atol=1e-6)
    ce_losses, _ = ce.losses_and_grads(clients, models, CFG, 1, with_grads=False)
    assert (losses - ce_losses).abs().min() > 1e-3

    # evaluation loss (and IFCA's full-data choice, which reads it)
    res = sim.evaluate(clients, models[1:], np.zeros(len(clients)))
    np.testing.assert_allclose(res.loss_sum, _manual_eval(model, models[1], fed, smoothed)[1], 1e-5)


def test_a_user_loss_by_import_path_or_from_python_gives_the_same_run(tmp_path):
    config = digits_config("loss", rounds=1, algorithms=[{"name": "ifca", "params": {}}])
    Experiment(validate_config(config), loss=smoothed).run(tmp_path / "python", progress=False)
    config["train"] = {"loss": "tests.engine.test_any_module:smoothed"}
    Experiment(validate_config(config)).run(tmp_path / "path", progress=False)
    assert_same_run(tmp_path / "python", tmp_path / "path")
    bad = {**config, "train": {"loss": "tests.engine.test_any_module:nowhere"}}
    with pytest.raises(ConfigError, match="train.loss: loss .* cannot be imported"):
        Experiment(validate_config(bad)).run(tmp_path / "bad", progress=False)


def test_clustering_compares_parameters_only(fed):
    """Rows that differ only in their BatchNorm statistics are one point to clustering."""
    model = _bn_model(fed)
    sim = Simulator(model, fed, seed=0)
    ctx = Context.for_backend(sim, CFG, 0, init_row(model, 0, "init"))
    rows = torch.stack([ctx.init_row, ctx.init_row])
    rows[1, ctx.channel.backend.layout.param_dim :] += 1.0
    a, b = ctx.compared(rows)
    assert torch.equal(a, b) and len(a) == ctx.channel.backend.layout.param_dim
    ctx.compare = "row"
    assert not torch.equal(*ctx.compared(rows))


def test_dp_sgd_refuses_batchnorm(fed):
    sim = Simulator(_bn_model(fed), fed, seed=0)
    dp = LocalTraining(lr=0.1, batch_size=16, dp=RecordDP(1.0, 1.0))
    with pytest.raises(Exception, match="BatchNorm"):
        sim.train(np.arange(2), init_row(sim.model, 0, "init"), dp, 1)
