"""The simulator's generic (autograd) training path for convolutional models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedcluster.algorithms.base import init_row
from fedcluster.data.federation import Federation
from fedcluster.engine.reference import reference_train
from fedcluster.engine.simulator import Simulator
from fedcluster.models import build_model
from fedcluster.protocol.batches import LocalTraining
from tests.helpers import assert_same_training


def _federation(sizes: list[int], shape: tuple[int, ...]) -> Federation:
    gen = torch.Generator().manual_seed(1)
    train = [(torch.rand(n, *shape, generator=gen), torch.arange(n) % 10) for n in sizes]
    return Federation.from_clients(train, [(x[:4], y[:4]) for x, y in train], 10)


@pytest.mark.parametrize("classifier_only", [False, True])
def test_per_parameter_leaves_give_the_flat_rows_gradient(classifier_only):
    """The step gradient equals autograd's gradient w.r.t. the whole flat row, restricted."""
    fed = _federation([16], (3, 32, 32))
    sim = Simulator(build_model("lenet", fed.input_shape, 10), fed, seed=0)
    w = init_row(sim.model, 0, "test")
    idx = torch.arange(16)
    head = sim.layout.classifier_range() if classifier_only else slice(0, sim.layout.dim)
    g, loss = sim.autograd_training.plain_gradient(w, idx, head)
    leaf = w.clone().requires_grad_(True)
    flat_loss = F.cross_entropy(sim.layout.forward(leaf, fed.x_train[idx]), fed.y_train[idx])
    (flat,) = torch.autograd.grad(flat_loss, leaf)
    assert torch.equal(g, flat[head]) and loss == float(flat_loss.detach())


@pytest.mark.parametrize("model_name,shape", [("lenet", (3, 32, 32)), ("cnn", (1, 28, 28))])
def test_clients_on_worker_threads_equal_the_plain_loop(model_name, shape):
    """Clients on 2 worker threads (one intra-op thread each) train as the plain loop does."""
    fed = _federation([20, 33, 12, 27], shape)
    model = build_model(model_name, shape, 10)
    cfg = LocalTraining(lr=0.05, batch_size=8, epochs=1)
    clients = np.arange(fed.n_clients)
    start = torch.stack([init_row(model, 0, "test", i) for i in clients])
    fast = Simulator(model, fed, seed=2, threads=2).train(clients, start, cfg, rnd=1)
    serial = Simulator(model, fed, seed=2, threads=1).train(clients, start, cfg, rnd=1)
    plain = reference_train(model, fed, clients, start, cfg, seed=2, rnd=1)
    # the workers' one intra-op thread and the plain loop's two sum in other orders
    assert_same_training(model, shape, cfg, fast.steps, fast.rows, plain)
    assert_same_training(model, shape, cfg, fast.steps, fast.rows, serial.rows)
    assert torch.equal(fast.steps, serial.steps)
    assert_same_training(model, shape, cfg, fast.steps, fast.loss, serial.loss)
    assert torch.get_num_threads() == 1  # restored after the workers


def test_a_parameter_the_forward_pass_does_not_use_gets_a_zero_gradient():
    """As with one flat leaf, a parameter outside the graph has gradient 0 (no error)."""

    class WithSpare(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(12, 10)
            self.spare = torch.nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x.flatten(1))

    fed = _federation([8], (1, 3, 4))
    sim = Simulator(WithSpare(), fed, seed=0)
    w = init_row(sim.model, 0, "test")
    g, _ = sim.autograd_training.plain_gradient(w, torch.arange(8), slice(0, sim.layout.dim))
    spare = next(s for s in sim.layout.slots if s.name == "spare")
    assert g.shape == (sim.layout.dim,)
    assert torch.equal(g[spare.start : spare.stop], torch.zeros(3))
    assert g.abs().sum() > 0
