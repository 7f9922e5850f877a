"""The batched simulator equals the plain per-client PyTorch loop (same init, same batches)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcluster.algorithms.base import init_row
from fedcluster.data.federation import Federation
from fedcluster.engine.flat import ParamLayout, weighted_average
from fedcluster.engine.kernel_training import (
    MAX_GROUP,
    balanced_group_size,
    nonzero_span,
    stack_plans,
)
from fedcluster.engine.reference import reference_train
from fedcluster.engine.simulator import Simulator
from fedcluster.models import build_model
from fedcluster.protocol.batches import LocalTraining, batch_plan
from tests.helpers import assert_same_training, evaluation_bounds, unequal_clients


@pytest.fixture(scope="module")
def mnist_federation(shared_dataset) -> Federation:
    """12 clients with unequal sizes (40..150 samples) of real MNIST digits."""
    return unequal_clients(shared_dataset("mnist"), 12, 40, 150, test_n=20, seed=0)


CONFIGS = {
    "sgd": LocalTraining(lr=0.1, batch_size=16, epochs=2),
    "prox": LocalTraining(lr=0.1, batch_size=16, epochs=1, mu=0.5),
    "momentum": LocalTraining(lr=0.05, batch_size=16, epochs=1, momentum=0.9),
    "prox_momentum": LocalTraining(lr=0.05, batch_size=16, epochs=2, momentum=0.9, mu=0.5),
    "steps": LocalTraining(lr=0.1, batch_size=32, steps=5),
}


# The MLP and MCLR run the kernel, the CNN the generic autograd path; two CNN configs
# keep the suite fast.
CASES = [(m, c) for m in ("mlp", "mclr") for c in CONFIGS] + [("cnn", "sgd"), ("cnn", "momentum")]


@pytest.mark.parametrize("model_name,cfg_name", CASES)
def test_batched_training_equals_plain_loop(mnist_federation, model_name, cfg_name):
    model = build_model(model_name, (1, 28, 28), 10)
    cfg = CONFIGS[cfg_name]
    clients = np.arange(mnist_federation.n_clients if model_name != "cnn" else 4)
    start = torch.stack([init_row(model, 0, "test", i) for i in range(len(clients))])
    sim = Simulator(model, mnist_federation, seed=7, group_size=3)
    result = sim.train(clients, start, cfg, rnd=2)
    fast = result.rows
    plain = reference_train(model, mnist_federation, clients, start, cfg, seed=7, rnd=2)
    assert_same_training(model, (1, 28, 28), cfg, result.steps, fast, plain)
    assert not torch.equal(fast, start)


@pytest.mark.parametrize(
    "cfg",
    [
        LocalTraining(lr=0.1, batch_size=140, steps=4),
        LocalTraining(lr=0.1, batch_size=200, epochs=3),
    ],
)
def test_full_batch_training_without_drawn_plans_equals_plain_loop(mnist_federation, cfg):
    # every batch a client's whole data (41..140 samples): the full-batch route, which
    # builds its row weights from the step counts instead of the drawn permutations
    model = build_model("mlp", (1, 28, 28), 10, hidden=[64])
    clients = np.arange(mnist_federation.n_clients)
    start = torch.stack([init_row(model, 0, "test", i) for i in range(len(clients))])
    sim = Simulator(model, mnist_federation, seed=7, group_size=5)
    assert sim.kernel_training.full_batch_steps(clients, cfg, False) is not None
    result = sim.train(clients, start, cfg, rnd=2)
    plain = reference_train(model, mnist_federation, clients, start, cfg, seed=7, rnd=2)
    assert_same_training(model, (1, 28, 28), cfg, result.steps, result.rows, plain)
    assert result.steps.tolist() == [cfg.steps or cfg.epochs] * len(clients)


@pytest.mark.parametrize("cfg_name", ["sgd", "prox_momentum"])
def test_groups_on_worker_threads_equal_plain_loop(mnist_federation, cfg_name):
    model = build_model("mlp", (1, 28, 28), 10, hidden=[64, 32])
    cfg = CONFIGS[cfg_name]
    clients = np.arange(mnist_federation.n_clients)
    start = torch.stack([init_row(model, 0, "test", i) for i in range(len(clients))])
    threaded = Simulator(model, mnist_federation, seed=3, group_size=2, threads=2)
    fast = threaded.train(clients, start, cfg, rnd=1)
    plain = reference_train(model, mnist_federation, clients, start, cfg, seed=3, rnd=1)
    assert_same_training(model, (1, 28, 28), cfg, fast.steps, fast.rows, plain)
    again = threaded.train(clients, start, cfg, rnd=1)
    assert torch.equal(fast.rows, again.rows) and torch.equal(fast.loss, again.loss)
    assert torch.get_num_threads() == 1  # the conftest's setting is restored


def test_nonzero_span_is_the_smallest_range_of_used_features():
    x = torch.zeros(4, 10)
    x[0, 3] = 1.0
    x[2, 7] = -2.0
    assert nonzero_span(x) == slice(3, 8)
    assert nonzero_span(torch.zeros(2, 5)) == slice(0, 0)
    assert nonzero_span(torch.ones(2, 5)) == slice(0, 5)


def test_kernel_and_autograd_paths_agree(mnist_federation):
    model = build_model("mlp", (1, 28, 28), 10, hidden=[64, 32])
    start = init_row(model, 0, "x")
    cfg = LocalTraining(lr=0.1, batch_size=16)
    clients = np.arange(mnist_federation.n_clients)
    kernel = Simulator(model, mnist_federation, seed=1).train(clients, start, cfg, 1)
    plain = Simulator(model, mnist_federation, seed=1, use_kernel=False).train(
        clients, start, cfg, 1
    )
    assert torch.equal(kernel.steps, plain.steps)
    assert_same_training(model, (1, 28, 28), cfg, kernel.steps, kernel.rows, plain.rows)
    assert_same_training(model, (1, 28, 28), cfg, kernel.steps, kernel.loss, plain.loss)


def test_classifier_only_training_leaves_features_untouched(mnist_federation):
    model = build_model("mlp", (1, 28, 28), 10, hidden=[32])
    sim = Simulator(model, mnist_federation, seed=0)
    start = init_row(model, 0, "x")
    head = sim.layout.classifier_range()
    for use_kernel in (True, False):
        sim = Simulator(model, mnist_federation, seed=0, use_kernel=use_kernel)
        rows = sim.train(np.arange(3), start, LocalTraining(lr=0.1), 1, classifier_only=True).rows
        assert torch.equal(rows[:, : head.start], start[: head.start].expand(3, -1))
        assert not torch.equal(rows[:, head], start[head].expand(3, -1))


@pytest.mark.parametrize("use_kernel", [True, False])
def test_losses_and_grads_match_autograd(mnist_federation, use_kernel):
    model = build_model("mlp", (1, 28, 28), 10, hidden=[16])
    models = torch.stack([init_row(model, 0, "m", k) for k in range(3)])
    sim = Simulator(model, mnist_federation, seed=3, use_kernel=use_kernel)
    cfg = LocalTraining(batch_size=8)
    clients = np.array([0, 5])
    loss, grads = sim.losses_and_grads(clients, models, cfg, rnd=4)
    plans = sim.plans(clients, LocalTraining(batch_size=8, steps=1), 4, "decide")
    layout = ParamLayout(model)
    for i in range(len(clients)):
        idx = plans[i][0]
        x, y = mnist_federation.x_train[idx], mnist_federation.y_train[idx]
        for k in range(3):
            w = models[k].clone().requires_grad_(True)
            ref = torch.nn.functional.cross_entropy(layout.forward(w, x), y)
            (g,) = torch.autograd.grad(ref, w)
            # one step's sums: the bound with steps = 1, at the scale of what is compared
            assert_same_training(model, (1, 28, 28), cfg, 1, loss[i, k], ref)
            assert_same_training(model, (1, 28, 28), cfg, 1, grads[i, k], g)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_gradient_products_equal_those_of_the_full_gradients(mnist_federation, use_kernel):
    model = build_model("mlp", (1, 28, 28), 10, hidden=[16, 8])
    models = torch.stack([init_row(model, 0, "m", k) for k in range(3)])
    directions = torch.stack([init_row(model, 0, "dir", k) for k in range(3)])
    sim = Simulator(model, mnist_federation, seed=3, use_kernel=use_kernel)
    cfg = LocalTraining(batch_size=8)
    clients = np.array([1, 4, 6])
    loss, grads = sim.losses_and_grads(clients, models, cfg, rnd=2)
    loss2, sq, dot = sim.losses_and_gradient_products(clients, models, directions, cfg, rnd=2)
    g = grads.double()
    assert torch.allclose(loss2, loss)
    assert torch.allclose(sq, g.square().sum(dim=2), rtol=1e-5)
    assert torch.allclose(
        dot, torch.einsum("nkd,kd->nk", g, directions.double()), rtol=1e-4, atol=1e-7
    )


def test_evaluate_counts_each_clients_own_test_samples(mnist_federation):
    model = build_model("mclr", (1, 28, 28), 10)
    rows = torch.stack([init_row(model, 0, "e", k) for k in range(2)])
    sim = Simulator(model, mnist_federation, seed=0)
    clients = np.arange(mnist_federation.n_clients)
    which = clients % 2
    res = sim.evaluate(clients, rows, which)
    layout = ParamLayout(model)
    # the kernel's products sum in other orders than the plain forward pass: a sample
    # may count differently only where the float32 bound leaves its argmax undecided
    _, undecided = evaluation_bounds(mnist_federation, model, rows)
    for c in clients:
        sl = mnist_federation.client_slice(c, "test")
        logits = layout.forward(rows[which[c]], mnist_federation.x_test[sl])
        own = int((logits.argmax(1) == mnist_federation.y_test[sl]).sum())
        assert abs(int(res.correct[c]) - own) <= undecided[c, which[c]]
        assert res.count[c] == sl.stop - sl.start


def test_batch_plan_is_deterministic_and_covers_each_epoch():
    cfg = LocalTraining(batch_size=32, epochs=2)
    a = batch_plan(100, cfg, 5, "train", 3, 9)
    b = batch_plan(100, cfg, 5, "train", 3, 9)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert [len(x) for x in a] == [32, 32, 32, 4] * 2
    assert sorted(torch.cat(a[:4]).tolist()) == list(range(100))
    other = batch_plan(100, cfg, 5, "train", 4, 9)
    assert not torch.equal(a[0], other[0])
    steps = batch_plan(10, LocalTraining(batch_size=4, steps=7), 0, "t", 0, 0)
    assert [len(x) for x in steps] == [4, 4, 2, 4, 4, 2, 4]


def test_weighted_average_by_sample_count():
    rows = torch.tensor([[1.0, 0.0], [3.0, 4.0]])
    avg = weighted_average(rows, torch.tensor([1, 3]))
    assert torch.allclose(avg, torch.tensor([2.5, 3.0]))


def test_a_nodes_one_client_simulator_trains_that_client_as_the_full_one(mnist_federation):
    """What a Flower node computes: its client alone, batches seeded by the global id.

    Equal up to float rounding: the node's products have other shapes (its own
    feature span, no padding from other group members), so sums run in another order.
    """
    model = build_model("mlp", (1, 28, 28), 10, hidden=[32])
    start = init_row(model, 0, "x")
    cfg = LocalTraining(lr=0.1, batch_size=16)
    full = Simulator(model, mnist_federation, seed=5).train(np.array([3, 7]), start, cfg, 2)
    for i, client in enumerate((3, 7)):
        own = mnist_federation.subset([client])
        assert torch.equal(
            own.x_train, mnist_federation.x_train[mnist_federation.client_slice(client)]
        )
        assert torch.equal(
            own.y_test, mnist_federation.y_test[mnist_federation.client_slice(client, "test")]
        )
        node = Simulator(model, own, seed=5, client_ids=np.array([client]))
        alone = node.train(np.array([0]), start, cfg, 2)
        assert_same_training(model, (1, 28, 28), cfg, full.steps[i], alone.rows[0], full.rows[i])
        assert torch.equal(alone.steps[0], full.steps[i])
    with pytest.raises(ValueError, match="client_ids"):
        Simulator(model, mnist_federation.subset([1, 2]), seed=5, client_ids=np.array([1]))


def test_equal_clients_train_in_place_with_cached_gram_matrices(shared_dataset):
    """The JGL benchmark's shape: equal clients (groups are ranges of output rows) small
    enough that their Gram matrices are cached; still the plain loop's result."""
    ds = shared_dataset("mnist")
    train = [
        (ds.train.x[i * 64 : (i + 1) * 64], ds.train.y[i * 64 : (i + 1) * 64]) for i in range(6)
    ]
    fed = Federation.from_clients(train, [(x[:8], y[:8]) for x, y in train], 10)
    model = build_model("mlp", (1, 28, 28), 10, hidden=[64, 32])
    cfg = LocalTraining(lr=0.1, batch_size=24, epochs=2)
    sim = Simulator(model, fed, seed=4, group_size=3)
    deferral = sim.kernel.deferral(cfg.batch_size)
    assert deferral > 1 and sim.kernel_training.grams.suits(deferral * cfg.batch_size)
    start = torch.stack([init_row(model, 0, "test", i) for i in range(6)])
    result = sim.train(np.arange(6), start, cfg, rnd=1)
    fast = result.rows
    plain = reference_train(model, fed, np.arange(6), start, cfg, seed=4, rnd=1)
    assert_same_training(model, (1, 28, 28), cfg, result.steps, fast, plain)
    again = sim.train(np.arange(6), start, cfg, rnd=1).rows  # from the filled cache
    assert torch.equal(fast, again)


def test_kernel_follows_in_place_changes_of_the_training_data(mnist_federation):
    """Drift changes samples in place: pixels that were black everywhere may light up,
    and the client's Gram matrix must be recomputed."""
    fed = mnist_federation.clone()
    model = build_model("mlp", (1, 28, 28), 10, hidden=[64, 32])
    cfg = LocalTraining(lr=0.1, batch_size=16)
    clients = np.arange(fed.n_clients)
    sim = Simulator(model, fed, seed=2)
    start = init_row(model, 0, "x")
    sim.train(clients, start, cfg, 1)
    assert not fed.x_train[:, 0, 0, :3].any()  # MNIST's top-left corner is black
    fed.x_train[fed.client_slice(0)][:, 0, 0, :3] = 1.0
    fed.data_changed(0)
    result = sim.train(clients, start, cfg, 2)
    plain = reference_train(model, fed, clients, start, cfg, seed=2, rnd=2)
    assert_same_training(model, (1, 28, 28), cfg, result.steps, result.rows, plain)


def test_default_groups_are_equal_and_keep_every_worker_busy():
    assert balanced_group_size(80, 2) == 8  # the round benchmark: 10 groups of 8
    assert balanced_group_size(24, 2) == 6  # the main job: 4 groups of 6, 2 per thread
    assert balanced_group_size(12, 2) == 6
    assert balanced_group_size(100, 2) == 7  # 15 groups: 8 and 7 per thread
    assert balanced_group_size(7, 1) == 7
    assert balanced_group_size(1, 2) == 1
    for n in range(1, 200):
        for workers in (1, 2, 4):
            size = balanced_group_size(n, workers)
            groups = math.ceil(n / size)
            assert 1 <= size <= MAX_GROUP
            assert groups >= min(n, workers)  # no worker idles while another has two groups
    assert balanced_group_size(2400, 2, largest=32) == 31  # IFCA's bf16 full batches: 78 groups


def test_stacked_plans_put_each_batch_in_its_slot_with_weight_one_over_its_size():
    gen = torch.Generator().manual_seed(3)
    plans = [
        [torch.randint(0, 99, (n,), generator=gen) for n in sizes]
        for sizes in ([5, 5, 2], [], [4], [5, 3, 1, 1])
    ]
    idx, weight = stack_plans(plans)
    assert idx.shape == (4, 4, 5) and weight.shape == (4, 4, 5)
    for g, plan in enumerate(plans):
        for s in range(4):
            n = len(plan[s]) if s < len(plan) else 0
            if n:
                assert torch.equal(idx[g, s, :n], plan[s])
                assert torch.equal(weight[g, s, :n], torch.full((n,), 1.0 / n))
            assert not idx[g, s, n:].any() and not weight[g, s, n:].any()  # padding
    empty_idx, empty_weight = stack_plans([[], []])
    assert empty_idx.shape == (2, 0, 1) and not empty_weight.numel()
