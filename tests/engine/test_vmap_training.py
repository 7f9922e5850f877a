"""Groups of clients trained at once with ``torch.func.vmap`` equal the client-by-client
autograd path (itself equal to the plain PyTorch loop): a CNN, a CNN with Dropout (the
same per-client masks), a ResNet-8 with BatchNorm (each client's running statistics),
a user loss, FedProx's term with momentum, classifier-only fine-tuning, unequal
clients, and FedBN. These run on the CPU device, as CI does; a GPU runs the same code."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedcluster.algorithms.base import init_row
from fedcluster.data.federation import Federation
from fedcluster.engine.simulator import Simulator
from fedcluster.engine.vmap_training import vmap_unsuitable
from fedcluster.errors import ConfigError
from fedcluster.models import build_model
from fedcluster.protocol.batches import LocalTraining
from tests.helpers import assert_same_training, rotated_digits


def smoothed(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Label-smoothed cross-entropy (ε = 0.2), written out."""
    logp = logits.log_softmax(dim=1)
    nll = -logp.gather(1, y.view(-1, 1)).squeeze(1)
    return (0.8 * nll - 0.2 * logp.mean(dim=1)).mean()


@pytest.fixture(scope="module")
def fed() -> Federation:
    return rotated_digits(n_groups=2, clients_per_group=3, per_client=40)


MODELS = {
    "cnn": lambda shape: build_model("cnn", shape, 10),
    "cnn_dropout": lambda shape: build_model("cnn", shape, 10, dropout=0.5),
    "resnet8_bn": lambda shape: build_model("fedcluster.models:resnet8", shape, 10, width=4),
}


def _both(model: nn.Module, fed: Federation, **options) -> tuple[Simulator, Simulator]:
    loop = Simulator(model, fed, seed=3, vmap="off", **options)
    grouped = Simulator(model, fed, seed=3, vmap="on", group_size=4, **options)
    assert loop.vmap_training is None and grouped.vmap_training is not None
    return loop, grouped


def _start(model: nn.Module, n: int) -> torch.Tensor:
    return torch.stack([init_row(model, 0, "test", i) for i in range(n)])


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize(
    "cfg",
    [
        LocalTraining(lr=0.05, batch_size=16),  # 40 samples: batches of 16, 16 and 8
        LocalTraining(lr=0.05, batch_size=16, steps=3, mu=0.1, momentum=0.9),
    ],
    ids=["epoch", "fedprox-momentum"],
)
def test_grouped_training_equals_the_client_by_client_path(fed, name, cfg):
    model = MODELS[name](fed.input_shape)
    loop, grouped = _both(model, fed)
    clients = np.arange(fed.n_clients)
    start = _start(model, fed.n_clients)
    want = loop.train(clients, start, cfg, rnd=2)
    got = grouped.train(clients, start, cfg, rnd=2)
    assert torch.equal(got.steps, want.steps)
    assert_same_training(model, fed.input_shape, cfg, got.steps, got.rows, want.rows)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-4, atol=1e-5)


def test_dropout_masks_are_each_clients_own_draws(fed):
    # with p = 0.9 most units are dropped: other masks would change the rows far beyond rounding
    model = build_model("cnn", fed.input_shape, 10, dropout=0.9)
    loop, grouped = _both(model, fed)
    cfg = LocalTraining(lr=0.1, batch_size=20, steps=2)
    clients = np.array([4, 1, 3])  # any subset, in any order: masks follow the client
    start = _start(model, 3)
    want = loop.train(clients, start, cfg, rnd=5)
    got = grouped.train(clients, start, cfg, rnd=5)
    assert_same_training(model, fed.input_shape, cfg, got.steps, got.rows, want.rows)
    other_round = grouped.train(clients, start, cfg, rnd=6)
    assert float((other_round.rows - got.rows).abs().max()) > 1e-3


def test_batchnorm_statistics_are_updated_per_client(fed):
    model = MODELS["resnet8_bn"](fed.input_shape)
    _, grouped = _both(model, fed)
    cfg = LocalTraining(lr=0.05, batch_size=16, steps=1)
    start = _start(model, 1).expand(fed.n_clients, -1)  # one start row for everyone
    rows = grouped.train(np.arange(fed.n_clients), start, cfg, rnd=1).rows
    buffers = rows[:, grouped.layout.param_dim :]
    # rotated groups see other pixels: their running statistics differ
    assert float((buffers[0] - buffers[1]).abs().max()) > 1e-4
    assert not torch.equal(buffers[0], start[0, grouped.layout.param_dim :])


def test_a_user_loss_and_classifier_only_training(fed):
    model = build_model("cnn", fed.input_shape, 10)
    loop, grouped = _both(model, fed, loss=smoothed)
    cfg = LocalTraining(lr=0.05, batch_size=16, steps=2)
    clients = np.arange(fed.n_clients)
    start = _start(model, fed.n_clients)
    for classifier_only in (False, True):
        want = loop.train(clients, start, cfg, rnd=1, classifier_only=classifier_only)
        got = grouped.train(clients, start, cfg, rnd=1, classifier_only=classifier_only)
        assert_same_training(model, fed.input_shape, cfg, got.steps, got.rows, want.rows)
    head = grouped.layout.classifier_range()
    assert torch.equal(got.rows[:, : head.start], start[:, : head.start])


def test_clients_of_unequal_sizes_and_fedbn(fed):
    sizes, x, y = [12, 40, 0, 27, 33], fed.x_train, fed.y_train
    starts = np.cumsum([0, *sizes])
    fed = Federation.from_clients(
        [(x[a:b], y[a:b]) for a, b in zip(starts[:-1], starts[1:], strict=True)],
        [(fed.x_test[:8], fed.y_test[:8])] * len(sizes),
        fed.n_classes,
    )
    model = MODELS["resnet8_bn"](fed.input_shape)
    loop, grouped = _both(model, fed, local_buffers=True)
    cfg = LocalTraining(lr=0.05, batch_size=16)
    clients = np.arange(fed.n_clients)
    start = _start(model, 1).expand(fed.n_clients, -1)
    for rnd in (1, 2):  # the second round starts from each client's own BatchNorm layers
        want = loop.train(clients, start, cfg, rnd=rnd)
        got = grouped.train(clients, start, cfg, rnd=rnd)
        assert got.steps.tolist() == [1, 3, 0, 2, 3]
        assert_same_training(model, fed.input_shape, cfg, got.steps, got.rows, want.rows)
        assert torch.isnan(got.loss[2]) and torch.isnan(want.loss[2])


class NoisyInput(nn.Module):
    """A forward pass that draws Gaussian noise: only the client-by-client path seeds it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        return self.linear(x + 0.1 * torch.randn_like(x) if self.training else x)


class ValueBranch(nn.Module):
    """Control flow on a value (``.item()``), which ``vmap`` cannot batch."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        return self.linear(x * 2 if x.mean().item() > 100 else x)


@pytest.mark.parametrize(
    ("model", "reason"),
    [(NoisyInput, "draws random numbers other than dropout"), (ValueBranch, "cannot batch")],
)
def test_a_model_vmap_cannot_take_stays_client_by_client(fed, model, reason):
    x, y = fed.x_train[:2], fed.y_train[:2]
    good = build_model("cnn", fed.input_shape, 10, dropout=0.5)
    assert vmap_unsuitable(good, F.cross_entropy, x, y) is None
    assert reason in vmap_unsuitable(model(), F.cross_entropy, x, y)
    with pytest.raises(ConfigError, match=f"vmap: on, but .*{reason}.*; set vmap: off"):
        Simulator(model(), fed, seed=0, vmap="on")


def test_auto_keeps_the_cpu_on_the_client_by_client_path_and_mlps_on_the_kernel(fed):
    assert Simulator(build_model("cnn", fed.input_shape, 10), fed, seed=0).vmap_training is None
    mlp = Simulator(build_model("mlp", fed.input_shape, 10), fed, seed=0, vmap="on")
    assert mlp.kernel_training is not None and mlp.vmap_training is None
