"""K models in one pass and each distinct test set once (``engine.model_eval``)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedcluster.algorithms.base import init_row
from fedcluster.data.federation import Federation
from fedcluster.engine import precision
from fedcluster.engine.flat import ParamLayout
from fedcluster.engine.model_eval import distinct_chunks
from fedcluster.engine.simulator import Simulator
from fedcluster.models import build_model
from fedcluster.protocol.batches import LocalTraining
from tests.helpers import FLOAT32_EPS, cross_entropy_error_bound, evaluation_bounds


@pytest.fixture(scope="module")
def shared_tests(shared_dataset) -> Federation:
    """9 clients of 30-70 real MNIST training digits; clients c and c + 3 share a test
    set (3 distinct sets of 25 digits, stored once per client as the presets pack them)."""
    ds = shared_dataset("mnist")
    rng = np.random.default_rng(0)
    train, test = [], []
    sets = [rng.choice(len(ds.test.y), 25, replace=False) for _ in range(3)]
    for c in range(9):
        ix = rng.choice(len(ds.train.y), int(rng.integers(30, 71)), replace=False)
        train.append((ds.train.x[ix], ds.train.y[ix]))
        test.append((ds.test.x[sets[c % 3]], ds.test.y[sets[c % 3]]))
    return Federation.from_clients(train, test, 10)


def _models(name: str, k: int) -> tuple[torch.nn.Module, torch.Tensor]:
    hidden = {"hidden": [64, 32]} if name == "mlp" else {}
    model = build_model(name, (1, 28, 28), 10, **hidden)
    return model, torch.stack([init_row(model, 0, "m", j) for j in range(k)])


def test_distinct_chunks_name_equal_test_sets_by_their_first_holder(shared_tests):
    fed = shared_tests
    assert distinct_chunks(fed.x_test, fed.y_test, fed.test_offsets).tolist() == [
        0, 1, 2, 0, 1, 2, 0, 1, 2
    ]  # fmt: skip
    x = fed.x_test.clone()
    x[fed.test_offsets[4]] += 1.0  # client 4's set now differs in one pixel
    assert distinct_chunks(x, fed.y_test, fed.test_offsets)[4] == 4
    # the same pixel values in another order (the same sum): still a different set
    x = fed.x_test.clone()
    row = x[fed.test_offsets[5]].view(-1)
    other = int(torch.nonzero(row != row[0])[0])
    row[0], row[other] = row[other].item(), row[0].item()
    assert distinct_chunks(x, fed.y_test, fed.test_offsets).tolist() == [
        0, 1, 2, 0, 1, 5, 0, 1, 2
    ]  # fmt: skip


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_deduplicated_evaluation_equals_per_client_evaluation(shared_tests, name):
    """All clients at once (each distinct test set computed once per model) gives the
    numbers of asking each client alone. The sample counts are equal by construction;
    the logits come from products over batches of other sizes (25 samples or 75, one
    model or three), whose kernels may sum in other orders, so the summed losses
    agree within the float32 bound of both evaluations and the correct predictions
    up to the samples whose argmax that bound leaves undecided."""
    model, rows = _models(name, 3)
    sim = Simulator(model, shared_tests, seed=0)
    loss_tol, undecided = evaluation_bounds(shared_tests, model, rows)
    clients = np.arange(shared_tests.n_clients)
    which = np.array([0, 1, 2, 1, 1, 0, 2, 2, 0])
    together = sim.evaluate(clients, rows, which)
    for c in clients:
        alone = sim.evaluate(np.array([c]), rows, which[c : c + 1])
        m = which[c]
        assert abs(int(alone.correct[0]) - int(together.correct[c])) <= undecided[c, m]
        assert abs(alone.loss_sum[0] - together.loss_sum[c]) <= 2 * loss_tol[c, m]
        assert alone.count[0] == together.count[c]
    hits, count, losses = sim.evaluate_models(clients, rows)
    for j in range(3):
        per_model = sim.evaluate(clients, rows, np.full(len(clients), j))
        assert np.all(np.abs(hits[:, j] - per_model.correct) <= undecided[:, j])
        assert np.all(np.abs(losses[:, j] - per_model.loss_sum) <= 2 * loss_tol[:, j])
    assert np.array_equal(count, np.full(9, 25))


def test_shared_test_sets_get_one_result(shared_tests):
    """Clients that share a test set receive the very result computed for it once:
    equal to the last bit (no second evaluation that could round otherwise)."""
    model, rows = _models("mlp", 3)
    sim = Simulator(model, shared_tests, seed=0)
    clients = np.arange(shared_tests.n_clients)
    which = np.zeros(len(clients), dtype=np.int64)
    result = sim.evaluate(clients, rows, which)
    hits, _, losses = sim.evaluate_models(clients, rows)
    for c in range(3, 9):  # client c shares client c % 3's test set
        assert result.loss_sum[c] == result.loss_sum[c % 3]
        assert result.correct[c] == result.correct[c % 3]
        assert np.array_equal(losses[c], losses[c % 3]) and np.array_equal(hits[c], hits[c % 3])


def _undecided_choice(losses: np.ndarray, tol: np.ndarray) -> np.ndarray:
    """Per client, whether the best model's loss lies within both evaluations' bounds
    (2·tol) of another model's: a different argmin is then within rounding."""
    order = np.argsort(losses, axis=1)
    rows = np.arange(len(losses))
    best, second = order[:, 0], order[:, 1]
    gap = losses[rows, second] - losses[rows, best]
    return gap <= 2 * (tol[rows, best] + tol[rows, second])


@pytest.mark.parametrize("name", ["mlp", "mclr"])
def test_k_model_losses_through_the_kernel_equal_each_models_own_loss(shared_tests, name):
    """IFCA's full-data choice (every client's summed loss under each of K models, one
    pass with the first layers' products in one) equals the loss of each model's own
    forward pass within the float32 bound of both evaluations, and picks the same
    model wherever that bound decides the choice."""
    model, rows = _models(name, 4)
    sim = Simulator(model, shared_tests, seed=0)
    assert sim.kernel is not None
    layout = ParamLayout(model)
    clients = np.arange(shared_tests.n_clients)
    hits, count, losses = sim.evaluate_models(clients, rows, split="train")
    loss_tol, undecided = evaluation_bounds(shared_tests, model, rows, split="train")
    expected = np.zeros((len(clients), 4))
    own_hits = np.zeros((len(clients), 4), dtype=np.int64)
    for c in clients:
        sl = shared_tests.client_slice(int(c))
        x, y = shared_tests.x_train[sl], shared_tests.y_train[sl]
        assert count[c] == len(y)
        for j in range(4):
            logits = layout.forward(rows[j], x)
            expected[c, j] = float(F.cross_entropy(logits, y, reduction="sum"))
            own_hits[c, j] = int((logits.argmax(1) == y).sum())
    assert np.all(np.abs(losses - expected) <= 2 * loss_tol)
    assert np.all(np.abs(hits - own_hits) <= undecided)
    decided = ~_undecided_choice(expected, loss_tol)
    assert decided.any()
    assert np.array_equal(losses.argmin(axis=1)[decided], expected.argmin(axis=1)[decided])


@pytest.mark.parametrize("name", ["mlp", "mclr"])
def test_one_batch_choice_through_the_kernel_equals_each_models_own_loss(shared_tests, name):
    """IFCA/JGL's one-mini-batch choice (``losses`` with ``batches: one``): all
    clients' batches go through the kernel together, batches of one size in one
    group (clients of fewer than 40 digits have a shorter first batch). Each
    client's loss under each model equals the mean cross-entropy of the model's
    own forward pass on that client's first decision batch within the float32
    bound of both evaluations, with the same choice wherever that bound decides it."""
    model, rows = _models(name, 4)
    sim = Simulator(model, shared_tests, seed=0)
    assert sim.kernel is not None
    layout = ParamLayout(model)
    clients = np.arange(shared_tests.n_clients)
    cfg = LocalTraining(lr=0.1, batch_size=40, steps=1)
    losses, grads = sim.losses_and_grads(clients, rows, cfg, 3, with_grads=False)
    assert grads is None
    plans = sim.plans(clients, cfg, 3, "decide")
    assert len({len(p[0]) for p in plans}) > 1  # two batch sizes: two groups
    expected = np.zeros((len(clients), 4))
    tol = np.zeros((len(clients), 4))
    for c in clients:
        idx = plans[c][0]
        x, y = shared_tests.x_train[idx], shared_tests.y_train[idx]
        for j in range(4):
            expected[c, j] = float(F.cross_entropy(layout.forward(rows[j], x), y))
            # a float32 mean of n losses: the samples' bounds, and n roundings of the sum
            per_sample, _ = cross_entropy_error_bound(layout, rows[j], x)
            tol[c, j] = float(per_sample.mean()) + len(y) * FLOAT32_EPS * expected[c, j]
    got = losses.double().numpy()
    assert np.all(np.abs(got - expected) <= 2 * tol)
    decided = ~_undecided_choice(expected, tol)
    assert decided.any()
    assert np.array_equal(got.argmin(axis=1)[decided], expected.argmin(axis=1)[decided])


# ----------------------------------------------------------------- bf16 precision
def test_cpu_bf16_capability_is_read_from_the_cpu_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n")
    assert not precision.cpu_has_bf16(info)
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n")
    assert precision.cpu_has_bf16(info)
    assert not precision.cpu_has_bf16(tmp_path / "absent")


def test_bf16_without_support_runs_fp32_with_one_warning(shared_tests, monkeypatch, caplog):
    monkeypatch.setattr(precision, "bf16_supported", lambda device: False)
    monkeypatch.setattr(precision, "_warned", set())
    model, rows = _models("mlp", 2)
    clients = np.arange(shared_tests.n_clients)
    cfg = LocalTraining(lr=0.1, batch_size=16, epochs=1)
    with caplog.at_level(logging.WARNING, logger="fedcluster.engine.precision"):
        sims = [Simulator(model, shared_tests, seed=0, precision="bf16") for _ in range(2)]
    assert len(caplog.records) == 1 and "running fp32" in caplog.records[0].getMessage()
    fp32 = Simulator(model, shared_tests, seed=0)
    assert sims[0].low is None and sims[0].kernel.low is None
    assert torch.equal(
        sims[0].train(clients, rows[0], cfg, 1).rows, fp32.train(clients, rows[0], cfg, 1).rows
    )


@pytest.mark.parametrize("steps", ["mini_batch", "full_batch"])
def test_bf16_products_train_and_evaluate_close_to_fp32(shared_tests, monkeypatch, steps):
    """bf16 operands (8 significant bits, relative rounding error 2⁻⁹) with fp32
    accumulation and fp32 master rows: a product's result carries up to three
    roundings (two operands, the output), about 3·2⁻⁹ relative, and a weight
    gradient passes through three products (forward, input gradient, weight
    gradient), so the training's movement of the rows is off by at most about
    9·2⁻⁹ < 2⁻⁴ of itself; the evaluation's losses (two products) within 4·2⁻⁸."""
    monkeypatch.setattr(precision, "bf16_supported", lambda device: True)
    model, rows = _models("mlp", 2)
    clients = np.arange(shared_tests.n_clients)
    cfg = (
        LocalTraining(lr=0.1, batch_size=16, epochs=1)
        if steps == "mini_batch"
        else LocalTraining(lr=0.1, batch_size=1000, steps=5)
    )
    low = Simulator(model, shared_tests, seed=0, precision="bf16")
    ref = Simulator(model, shared_tests, seed=0)
    assert low.kernel.low is torch.bfloat16
    mode = torch.backends.mkldnn.matmul.fp32_precision
    a, b = low.train(clients, rows[0], cfg, 1).rows, ref.train(clients, rows[0], cfg, 1).rows
    assert torch.backends.mkldnn.matmul.fp32_precision == mode  # oneDNN's bf16 mode left
    moved = float((b - rows[0]).abs().max())
    assert 0 < float((a - b).abs().max()) <= 2**-4 * moved
    la = low.evaluate_models(clients, rows)[2]
    lb = ref.evaluate_models(clients, rows)[2]
    np.testing.assert_allclose(la, lb, rtol=4 * 2**-8)
