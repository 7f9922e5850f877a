"""The round benchmark's CNN rows: simulator vs plain loop on convolutional models.

Goal: the simulator >= 1.1x the plain loop, never slower.
One FedAvg round -- 16 clients x 200 training images, B = 32, lr 0.05, one
local epoch, plain SGD, then the sample-weighted average -- for

- ``jgl-cnn``: JGL Fig. 3's CNN on MNIST (conv 32@3x3, conv 64@3x3, maxpool 2,
  fc 128, fc 10; :func:`fedcluster.models.cnn` on 1x28x28);
- ``lenet``: JGL Fig. 3's CIFAR-10 CNN (LeNet-like, :func:`fedcluster.models.lenet`
  on 3x32x32; it is also what ``cnn`` builds for CIFAR-10),
- ``resnet8``: a CIFAR ResNet-8 with BatchNorm (:func:`fedcluster.models.resnet8`,
  width 16; its running statistics train and travel in the row),
- ``lenet-dropout``: LeNet with ``nn.Dropout(0.5)`` after fc 120 and fc 84 (masks
  from the clients' derived generators),

timed interleaved round by round in one process:

(a) ``Simulator.train`` as configured by default (clients on worker threads,
    one intra-op thread each, :meth:`AutogradTraining.train`);
(a') ``Simulator(threads=--threads)``: the same with a fixed worker count
    (the default steps down to fewer workers while other processes keep CPUs
    busy, :mod:`fedcluster.engine.threads`);
(b) ``Simulator(threads=1)``: the same per-client autograd loop in the calling
    thread with all intra-op threads (what the simulator did before);
(v) ``Simulator(vmap="on")``: groups of ``--vmap-group`` clients at once through
    ``torch.func`` (:class:`~fedcluster.engine.vmap_training.VmapTraining`);
(c) ``engine.reference.reference_train``: one ``nn.Module``, ``torch.optim.SGD``.

Flower is not run here (``bench_round.py``'s Flower workload is the MLP). The
roofline counts the convolutions' and linear layers' multiply-adds (forward,
weight gradient, input gradient except for the first layer) against the
measured fp32 ``torch.mm`` peak; the script also checks that (a), (b) and (v) equal
(c) to float rounding and prints the load average.

Run from the repository root::

    python -m benchmarks.performance.bench_cnn --rounds 3 --out cnn.json
    python -m benchmarks.performance.bench_cnn --rounds 3 --models resnet8,lenet-dropout
    python -m benchmarks.performance.bench_cnn --device cuda --rounds 2 --data-dir DIR \\
        --out cnn-gpu.json

With ``--device cuda`` the federation, the simulator and the plain loop run on
the GPU (timers bracket ``torch.cuda.synchronize()``) and the roofline peak is
the GPU's fp32 ``torch.mm`` throughput.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.common import add_device_argument, save_run
from benchmarks.performance.bench_round import (
    THREADS,
    default_data_dir,
    matmul_peak,
    measure,
    summarize,
)
from fedcluster.algorithms.base import init_row
from fedcluster.data.federation import Federation
from fedcluster.data.sources import load_dataset
from fedcluster.engine.device import resolve_device
from fedcluster.engine.flat import weighted_average
from fedcluster.engine.reference import reference_train
from fedcluster.engine.simulator import Simulator
from fedcluster.engine.vmap_training import VMAP_GROUP
from fedcluster.models import build_model
from fedcluster.protocol.batches import LocalTraining

N_CLIENTS, TRAIN_SIZE, TEST_SIZE, BATCH, LR, SEED = 16, 200, 20, 32, 0.05, 0
WORKLOADS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "jgl-cnn": ("mnist", "cnn", {}),
    "lenet": ("cifar10", "lenet", {}),
    "resnet8": ("cifar10", "fedcluster.models:resnet8", {}),
    "lenet-dropout": ("cifar10", "lenet", {"dropout": 0.5}),
}


def build(name: str, data_dir: Path, n_clients: int) -> tuple[Federation, nn.Module]:
    """``n_clients`` x 200 consecutive training images of the dataset, and the model."""
    dataset, model_name, options = WORKLOADS[name]
    ds = load_dataset(dataset, data_dir)
    assert ds.test is not None
    train = [
        (
            ds.train.x[c * TRAIN_SIZE : (c + 1) * TRAIN_SIZE],
            ds.train.y[c * TRAIN_SIZE : (c + 1) * TRAIN_SIZE],
        )
        for c in range(n_clients)
    ]
    test = [
        (
            ds.test.x[c * TEST_SIZE : (c + 1) * TEST_SIZE],
            ds.test.y[c * TEST_SIZE : (c + 1) * TEST_SIZE],
        )
        for c in range(n_clients)
    ]
    fed = Federation.from_clients(train, test, len(ds.classes))
    return fed, build_model(model_name, fed.input_shape, fed.n_classes, **options)


def layer_flops(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Multiply-add FLOPs per sample of one SGD step: forward + weight gradient +
    input gradient (not for the first layer), over Conv2d and Linear layers."""
    per_layer: list[int] = []

    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if isinstance(module, nn.Conv2d):
            k = module.kernel_size[0] * module.kernel_size[1] * module.in_channels // module.groups
            per_layer.append(2 * output[0].numel() * k)
        elif isinstance(module, nn.Linear):
            per_layer.append(2 * module.in_features * module.out_features)

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    with torch.no_grad():
        model(torch.zeros(1, *input_shape, device=next(model.parameters()).device))
    for h in handles:
        h.remove()
    return 2 * sum(per_layer) + sum(per_layer[1:])


def run_workload(
    name: str, args: argparse.Namespace, peak: float, device: torch.device
) -> dict[str, Any]:
    fed, model = build(
        name, Path(args.data_dir) if args.data_dir else default_data_dir(), args.clients
    )
    row = init_row(model, SEED, "init")  # on the CPU: the same start row on every device
    fed, model = fed.to(device), model.to(device)
    cfg = LocalTraining(lr=LR, batch_size=BATCH, epochs=1)
    clients = np.arange(fed.n_clients)
    weights = torch.as_tensor(fed.train_sizes)
    sims = {
        "simulator": Simulator(model, fed, seed=SEED),
        "simulator_fixed": Simulator(model, fed, seed=SEED, threads=args.threads),
        "simulator_serial": Simulator(model, fed, seed=SEED, threads=1),
        "simulator_vmap": Simulator(model, fed, seed=SEED, vmap="on", group_size=args.vmap_group),
    }
    runs: dict[str, Callable[[int], torch.Tensor]] = {
        k: (lambda rnd, s=s: weighted_average(s.train(clients, row, cfg, rnd).rows, weights))
        for k, s in sims.items()
    }
    runs["plain_loop"] = lambda rnd: weighted_average(
        reference_train(model, fed, clients, row, cfg, SEED, rnd), weights
    )
    plain = reference_train(model, fed, clients, row, cfg, SEED, 1)
    diffs = {
        k: float((s.train(clients, row, cfg, 1).rows - plain).abs().max()) for k, s in sims.items()
    }
    samples: dict[str, list] = {k: [] for k in runs}
    for r in range(args.warmup + args.rounds):
        parts = []
        for k, fn in runs.items():
            dt, share = measure(lambda fn=fn, r=r: fn(100 + r))
            if r >= args.warmup:
                samples[k].append((dt, share))
            parts.append(f"{k} {dt:.3f}s")
        print(f"  {name} round {r - args.warmup + 1}: " + ", ".join(parts), flush=True)
    local = {k: summarize(v, 1.0) for k, v in samples.items()}
    flops = layer_flops(model, fed.input_shape) * int(fed.train_sizes.sum())
    roof = flops / (peak * 1e9)
    sim_s, plain_s = local["simulator"]["median"], local["plain_loop"]["median"]
    vmap_s = local["simulator_vmap"]["median"]
    return {
        "dataset": WORKLOADS[name][0],
        "model": WORKLOADS[name][1],
        "options": WORKLOADS[name][2],
        "clients": fed.n_clients,
        "seconds_per_round": local,
        "speedup_vs_plain": plain_s / sim_s,
        "vmap_speedup_vs_plain": plain_s / vmap_s,
        "round_gflop": flops / 1e9,
        "roofline_seconds": roof,
        "roofline_fraction": roof / sim_s,
        "max_abs_diff_vs_plain": diffs,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--clients", type=int, default=N_CLIENTS)
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--vmap-group", type=int, default=VMAP_GROUP, help="clients per vmap")
    ap.add_argument("--models", default=",".join(WORKLOADS), help="comma-separated workloads")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default=None)
    add_device_argument(ap)
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    peak = matmul_peak(device=device)
    results = {
        name: run_workload(name, args, peak["gflops"], device) for name in args.models.split(",")
    }
    print(
        f"\n{'workload':<14}{'simulator':>11}{'sim fixed':>11}{'sim 1 thr':>11}{'vmap':>9}"
        f"{'loop':>9}{'speedup':>9}{'vmap x':>8}{'roof':>7}"
    )
    for name, r in results.items():
        s = r["seconds_per_round"]
        worst = max(r["max_abs_diff_vs_plain"].values())
        print(
            f"{name:<14}{s['simulator']['median']:11.3f}{s['simulator_fixed']['median']:11.3f}"
            f"{s['simulator_serial']['median']:11.3f}{s['simulator_vmap']['median']:9.3f}"
            f"{s['plain_loop']['median']:9.3f}{r['speedup_vs_plain']:8.2f}x"
            f"{r['vmap_speedup_vs_plain']:7.2f}x"
            f"{r['roofline_fraction']:7.1%}   max|diff| vs loop {worst:.1e}"
        )
    load_after = os.getloadavg()
    print(
        f"device {device}; matmul peak {peak['gflops']:.1f} GFLOP/s; threads {args.threads}; "
        f"load {load_before} / {load_after}"
    )
    print("goal: simulator >= 1.1x the plain loop")
    save_run(
        args.out, results, load_before, threads=args.threads, device=str(device), matmul_peak=peak
    )
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
