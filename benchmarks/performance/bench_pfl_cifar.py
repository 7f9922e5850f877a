"""pfl-research's CIFAR-10 benchmark, side by side: fedcluster, ``pfl`` and a plain loop.

The setup of pfl-research's image-classification benchmark (``cifar10_iid``,
``simple_cnn``, FedAvg; its ``configs/baseline.yaml``): 1,000 clients of 50
CIFAR-10 training images, 50 clients per round, local SGD with lr 0.1, batch 10,
one epoch, the uniform mean of the clients' models as the new model (central
lr 1.0, users weighted equally), and its small CNN (conv 32@3x3, conv 64@3x3,
maxpool 2, Dropout 0.25, fc 128, Dropout 0.5, fc 10; Glorot-uniform weights:
1.6M parameters). The same clients, the same rounds' cohorts and the same
initial model for every variant, one process, ``--threads`` threads:

- ``fedcluster``: ``fedcluster.run`` with FedAvg (the whole round: channel,
  byte counting, aggregation), per-round seconds from its ``metrics.csv``;
- ``sim-loop`` / ``sim-vmap``: the simulator's local training
  (``Simulator.train``) client by client, or in groups through ``torch.func``
  (``vmap: on``), plus the mean;
- ``plain``: one ``nn.Module`` and ``torch.optim.SGD`` per client
  (:func:`fedcluster.engine.reference.reference_train`), plus the mean;
- ``pfl``: ``pfl`` 0.6.0's ``FederatedAveraging`` on its ``SimulatedBackend``
  with a ``PyTorchModel`` (``pip install pfl==0.6.0``; skipped when absent).

Each variant runs ``--rounds`` rounds after ``--warmup``; the table gives the
median seconds per round, the ratio to ``pfl`` and the test accuracy on the
10,000 CIFAR-10 test images after the rounds. Run from the repository root::

    python -m benchmarks.performance.bench_pfl_cifar --rounds 10 --out pfl.json
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import default_data_dir, save_run
from fedcluster.data.federation import Federation
from fedcluster.data.sources import load_dataset
from fedcluster.engine.flat import ParamLayout
from fedcluster.engine.reference import reference_train
from fedcluster.engine.simulator import Simulator
from fedcluster.protocol.batches import LocalTraining
from fedcluster.rng import numpy_rng

N_CLIENTS, PER_CLIENT, COHORT, BATCH, LR, SEED = 1000, 50, 50, 10, 0.1, 0


class SimpleCNN(nn.Sequential):
    """pfl-research's ``simple_cnn`` for 3x32x32 images, with the ``loss`` and
    ``metrics`` methods ``pfl``'s ``PyTorchModel`` calls."""

    def __init__(self) -> None:
        super().__init__(
            nn.Conv2d(3, 32, 3),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(0.25),
            nn.Flatten(),
            nn.Linear(14 * 14 * 64, 128),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(128, 10),
        )
        generator = torch.Generator().manual_seed(SEED)
        for m in self.modules():
            if isinstance(m, nn.Conv2d | nn.Linear):
                nn.init.xavier_uniform_(m.weight, generator=generator)
                nn.init.zeros_(m.bias)

    def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:
        self.train(not eval)
        return F.cross_entropy(self(x), y)

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = True) -> dict[str, Any]:
        from pfl.metrics import Weighted

        self.train(not eval)
        logits = self(x)
        return {
            "loss": Weighted(float(F.cross_entropy(logits, y, reduction="sum")), len(y)),
            "accuracy": Weighted(float((logits.argmax(1) == y).sum()), len(y)),
        }


def federation(data_dir: Path) -> tuple[Federation, torch.Tensor, torch.Tensor]:
    """1,000 clients of 50 consecutive training images (CIFAR-10's order is random)
    and 10 test images each (together the whole test set), and the test set."""
    ds = load_dataset("cifar10", data_dir)
    assert ds.test is not None
    train = [
        (
            ds.train.x[c * PER_CLIENT : (c + 1) * PER_CLIENT],
            ds.train.y[c * PER_CLIENT : (c + 1) * PER_CLIENT],
        )
        for c in range(N_CLIENTS)
    ]
    test = [
        (ds.test.x[c * 10 : (c + 1) * 10], ds.test.y[c * 10 : (c + 1) * 10])
        for c in range(N_CLIENTS)
    ]
    fed = Federation.from_clients(train, test, 10)
    return fed, torch.as_tensor(ds.test.x), torch.as_tensor(ds.test.y)


def cohort(rnd: int) -> np.ndarray:
    """The round's 50 clients, the same for every variant."""
    return np.sort(numpy_rng(SEED, "cohort", rnd).choice(N_CLIENTS, COHORT, replace=False))


@torch.no_grad()
def accuracy(model: nn.Module, row: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    net = copy.deepcopy(model).eval()
    ParamLayout(net).load_into(net, row)
    hits = sum(
        int((net(x[i : i + 2000]).argmax(1) == y[i : i + 2000]).sum())
        for i in range(0, len(y), 2000)
    )
    return hits / len(y)


def mean_rounds(
    train: Callable[[np.ndarray, torch.Tensor, int], torch.Tensor], start: torch.Tensor, rounds: int
) -> tuple[list[float], torch.Tensor]:
    """FedAvg with equal weights on ``train``'s rows; each round's seconds, the last model."""
    row, seconds = start, []
    for rnd in range(1, rounds + 1):
        t = time.perf_counter()
        row = train(cohort(rnd), row, rnd).mean(dim=0)
        seconds.append(time.perf_counter() - t)
    return seconds, row


def run_fedcluster(fed: Federation, model: nn.Module, rounds: int) -> tuple[list[float], float]:
    """``fedcluster.run`` with FedAvg: seconds per round (client + server) and the test
    accuracy after the last round (the clients' test images are the whole test set).
    Its cohorts are drawn by its own participation rule and its model initialised by
    ``init_row`` (PyTorch's default initialisation), so its accuracy is comparable,
    not identical."""
    import fedcluster

    with tempfile.TemporaryDirectory() as out:
        result = fedcluster.run(
            model=model,
            federation=fed,
            algorithms=["fedavg"],
            rounds=rounds,
            out=Path(out) / "run",
            report=False,
            train={"lr": LR, "batch_size": BATCH, "epochs": 1},
            config={"participation": {"count": COHORT}, "eval_every": rounds},
        )
    seconds = [float(r["client_seconds"]) + float(r["server_seconds"]) for r in result.metrics]
    return seconds, float(result.metrics[-1]["accuracy"])


def run_pfl(fed: Federation, model: nn.Module, rounds: int) -> tuple[list[float], torch.Tensor]:
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByUser
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.model.pytorch import PyTorchModel

    net = copy.deepcopy(model)
    rounds_left = iter(range(1, rounds + 1))
    cohorts: list[int] = []

    def sampler() -> int:
        if not cohorts:
            cohorts.extend(cohort(next(rounds_left)).tolist())
        return cohorts.pop(0)

    def user_data(c: int) -> Dataset:
        part = fed.client_slice(c, "train")
        return Dataset((fed.x_train[part], fed.y_train[part]), user_id=c)

    class Clock(TrainingProcessCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.last = time.perf_counter()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):  # type: ignore[no-untyped-def]
            now = time.perf_counter()
            self.seconds.append(now - self.last)
            self.last = now
            return False, aggregate_metrics.__class__()

    params = [p for p in net.parameters() if p.requires_grad]
    pfl_model = PyTorchModel(
        model=net,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(params, 1.0),
    )
    backend = SimulatedBackend(
        training_data=FederatedDataset(user_data, sampler),
        val_data=None,
        postprocessors=[WeightByUser()],
    )
    clock = Clock()
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=rounds,
            evaluation_frequency=rounds + 1,
            train_cohort_size=COHORT,
            val_cohort_size=0,
        ),
        backend=backend,
        model=pfl_model,
        model_train_params=NNTrainHyperParams(
            local_learning_rate=LR, local_num_epochs=1, local_batch_size=BATCH
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=1000),
        callbacks=[clock],
    )
    return clock.seconds, ParamLayout(net).flatten(net)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2, help="rounds left out of the timing")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--variants", default="plain,sim-loop,sim-vmap,fedcluster,pfl")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    fed, x_test, y_test = federation(
        Path(args.data_dir) if args.data_dir else Path(default_data_dir())
    )
    model = SimpleCNN()
    start = ParamLayout(model).flatten(model)
    cfg = LocalTraining(lr=LR, batch_size=BATCH, epochs=1)
    loop = Simulator(model, fed, seed=SEED, vmap="off")
    grouped = Simulator(model, fed, seed=SEED, vmap="on", group_size=COHORT)
    variants: dict[str, Callable[[], tuple[list[float], torch.Tensor | float]]] = {
        "plain": lambda: mean_rounds(
            lambda c, row, rnd: reference_train(model, fed, c, row, cfg, SEED, rnd),
            start,
            args.rounds,
        ),
        "sim-loop": lambda: mean_rounds(
            lambda c, row, rnd: loop.train(c, row, cfg, rnd).rows, start, args.rounds
        ),
        "sim-vmap": lambda: mean_rounds(
            lambda c, row, rnd: grouped.train(c, row, cfg, rnd).rows, start, args.rounds
        ),
        "fedcluster": lambda: run_fedcluster(fed, model, args.rounds),
        "pfl": lambda: run_pfl(fed, model, args.rounds),
    }
    results: dict[str, Any] = {}
    for name in args.variants.split(","):
        if name == "pfl":
            try:
                import pfl  # noqa: F401
            except ImportError:
                print("pfl is not installed (pip install pfl==0.6.0): skipped")
                continue
        seconds, final = variants[name]()
        timed = seconds[args.warmup :]
        results[name] = {
            "seconds_per_round": statistics.median(timed),
            "rounds_timed": len(timed),
            "all_seconds": seconds,
            "test_accuracy": final
            if isinstance(final, float)
            else accuracy(model, final, x_test, y_test),
        }
        print(
            f"{name:<11} {results[name]['seconds_per_round']:.3f} s/round  "
            f"acc {results[name]['test_accuracy']:.4f}",
            flush=True,
        )
    base = results.get("pfl", {}).get("seconds_per_round")
    print(f"\n{'variant':<11}{'s/round':>9}{'vs pfl':>8}{'test acc':>10}")
    for name, r in results.items():
        ratio = f"{base / r['seconds_per_round']:7.2f}x" if base else "      -"
        print(f"{name:<11}{r['seconds_per_round']:9.3f}{ratio}{r['test_accuracy']:10.4f}")
    print(
        f"threads {args.threads}; rounds {args.rounds} ({args.warmup} warm-up); "
        f"load {load_before} / {os.getloadavg()}"
    )
    save_run(args.out, results, load_before, threads=args.threads, rounds=args.rounds)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
