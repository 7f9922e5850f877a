# ruff: noqa: E402  (the run-as-module shim below precedes the imports)
"""IFCA's 2,400-client rotated-MNIST round: fedcluster vs a loop written like IFCA's code.

The workload of the preset ``ifca-rotated-mnist`` (Ghosh et al. 2020, reference
code ``mnist/train_cluster_mnist.py``): m clients in 4 rotation groups (default
600 per group, 100 MNIST images each), MLP 784-200-10, K = 4 cluster models,
tau = 10 full-batch steps at lr 0.1. One IFCA round is timed part by part:

1. choice: every client's loss under each of the K models on its whole
   training set (``IFCA`` with ``choice_batches: all``);
2. training: ``Simulator.train`` from each client's chosen model (the
   full-batch kernel route, :meth:`MLPKernel.sgd_full_batch`);
3. aggregation: the per-cluster average;
4. evaluation: the own-loss test protocol (every client's test chunk under
   every model, :func:`fedcluster.algorithms.evaluation.own_loss_evaluate`).

Against it, in the same process, the same round written the way IFCA's reference
code works: per client, the K models evaluated one by one (``loss.item()``,
correct counts), a ``copy.deepcopy`` of the chosen model trained with autograd
and a manual parameter update, the updates averaged per cluster from
``named_parameters``, and the test clients evaluated one by one. With
``--ref-clients`` smaller than m the loop runs on that many clients (every
group equally) and its time is scaled linearly to m (stated in the output).
The script checks that both rounds give the same cluster models.

Load matters on a shared machine: the output records ``os.getloadavg()``
before and after; compare only ratios from one run.

    python benchmarks/performance/bench_ifca.py --out ifca.json            # the full 2,400 clients
    # a quick check:
    python benchmarks/performance/bench_ifca.py --clients-per-group 30 --ref-clients 120
    python benchmarks/performance/bench_ifca.py --rounds 2 --precision bf16  # bf16 products
    python benchmarks/performance/bench_ifca.py --device cuda --clients-per-group 60 --rounds 2 \
        --data-dir DIR --out ifca-gpu.json                      # on a GPU

With ``--device cuda`` the federation, the simulator and the reference loop run
on the GPU; every time stamp follows ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run by path: as the module (as_module.py)
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.as_module import run_as_module

    run_as_module(__file__)
    raise SystemExit(0)

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import add_device_argument, synchronize
from benchmarks.performance.bench_round import machine_info
from fedcluster.algorithms.aggregation import cluster_average
from fedcluster.algorithms.base import Context
from fedcluster.algorithms.evaluation import own_loss_evaluate
from fedcluster.config.schema import resolve_config
from fedcluster.data.configured import build_federation_for
from fedcluster.data.federation import Federation
from fedcluster.engine.client_computations import LOSSES
from fedcluster.engine.device import resolve_device
from fedcluster.engine.flat import ParamLayout
from fedcluster.engine.precision import PRECISIONS
from fedcluster.engine.simulator import Simulator
from fedcluster.models import build_model
from fedcluster.protocol.batches import LocalTraining
from fedcluster.protocol.computation import Request

REPO = Path(__file__).resolve().parents[2]


def build(clients_per_group: int, data_dir: str) -> tuple[Federation, object]:
    sets = [
        f"data.data_dir={data_dir}",
        f"data.partition.base_options.n_clients={clients_per_group}",
        f"data.partition.test_clients={min(100, clients_per_group)}",
    ]
    cfg = resolve_config(preset="ifca-rotated-mnist", sets=sets)
    return build_federation_for(cfg, 0), cfg


def _stamp() -> float:
    """A time stamp after the GPU's queued work (if any) has finished."""
    synchronize()
    return time.perf_counter()


def _parts(*stamps: float) -> dict[str, float]:
    """Seconds of the round's parts from the time stamps between them."""
    names = ("choice_s", "train_s", "aggregate_s", "evaluate_s")
    out = {n: b - a for n, a, b in zip(names, stamps, stamps[1:], strict=False)}
    return out | {"round_s": stamps[-1] - stamps[0]}


def fast_round(sim: Simulator, models: torch.Tensor, cfg, rnd: int) -> dict:
    """One IFCA round on the simulator, part by part; returns times and new models."""
    clients = np.arange(sim.federation.n_clients)
    train = LocalTraining(**cfg.train.model_dump(exclude={"loss"}))
    ctx = Context.for_backend(sim, train, 0, models[0])
    t0 = _stamp()
    request = Request(
        shared={"models": models}, settings={"train": train, "round": rnd, "batches": "all"}
    )
    choice = ctx.ask(LOSSES, clients, request, rnd)["losses"].numpy().argmin(axis=1)
    t1 = _stamp()
    trained = sim.train(clients, models[choice], train, rnd)
    t2 = _stamp()
    new = cluster_average(trained.rows, choice, models)
    t3 = _stamp()
    result, _ = own_loss_evaluate(ctx, clients, new, rnd)
    t4 = _stamp()
    accuracy = float(result.correct.sum() / result.count.sum())
    return _parts(t0, t1, t2, t3, t4) | {"models": new, "choice": choice, "accuracy": accuracy}


def reference_round(
    model: nn.Module,
    fed: Federation,
    models: torch.Tensor,
    clients: np.ndarray,
    lr: float,
    tau: int,
) -> dict:
    """The round as IFCA's reference code writes it (one module per model, loops per client)."""
    layout = ParamLayout(model)
    k = models.shape[0]
    nets = []
    for j in range(k):
        net = copy.deepcopy(model)
        layout.load_into(net, models[j])
        nets.append(net)
    t0 = _stamp()
    choice = []
    with torch.no_grad():  # get_inference_stats(train=True)
        for c in clients:
            sl = fed.client_slice(int(c))
            x, y = fed.x_train[sl], fed.y_train[sl]
            losses = []
            for j in range(k):
                logits = nets[j](x)
                losses.append(F.cross_entropy(logits, y).item())
                _ = (logits.argmax(1) == y).sum().item()
            choice.append(int(np.argmin(losses)))
    t1 = _stamp()
    updated = []
    for c, j in zip(clients, choice, strict=True):  # train(cluster_assign, lr)
        sl = fed.client_slice(int(c))
        x, y = fed.x_train[sl], fed.y_train[sl]
        local = copy.deepcopy(nets[j])
        for _ in range(tau):
            loss = F.cross_entropy(local(x), y)
            local.zero_grad()
            loss.backward()
            for p in local.parameters():
                p.data -= lr * p.grad
        updated.append(local)
    t2 = _stamp()
    new = models.clone()
    for j in range(k):  # global_param_update
        members = [m for m, cj in zip(updated, choice, strict=True) if cj == j]
        if not members:
            continue
        sums: dict[str, torch.Tensor] = {}
        for m in members:
            for name, p in m.named_parameters():
                sums[name] = sums.get(name, 0) + p.data
        for name, p in nets[j].named_parameters():
            p.data = sums[name] / len(members)
        new[j] = layout.flatten(nets[j])
    t3 = _stamp()
    with torch.no_grad():  # get_inference_stats(train=False): the distinct test clients
        seen = set()
        for c in clients:
            sl = fed.client_slice(int(c), "test")
            key = (sl.start, sl.stop)
            if key in seen:
                continue
            seen.add(key)
            x, y = fed.x_test[sl], fed.y_test[sl]
            for j in range(k):
                logits = nets[j](x)
                _ = F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).sum().item()
    t4 = _stamp()
    return _parts(t0, t1, t2, t3, t4) | {"models": new, "choice": np.array(choice)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients-per-group", type=int, default=600)
    p.add_argument("--ref-clients", type=int, default=None, help="reference loop on fewer clients")
    p.add_argument("--rounds", type=int, default=3, help="timed simulator rounds (median)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--data-dir", default=os.environ.get("FEDCLUSTER_DATA", str(REPO.parent / "shared/data"))
    )
    p.add_argument("--out", default=None)
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="the simulator's matrix products (bf16: fp32 accumulation, fp32 parameters)",
    )
    add_device_argument(p)
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    fed, cfg = build(args.clients_per_group, args.data_dir)
    model = build_model("mlp", fed.input_shape, fed.n_classes, hidden=[200])
    layout = ParamLayout(model)
    gen = torch.Generator().manual_seed(0)
    models = torch.stack(
        [layout.flatten(build_model("mlp", fed.input_shape, 10, hidden=[200])) for _ in range(4)]
    )
    del gen
    fed = fed.to(device)
    sim = Simulator(model, fed, seed=0, precision=args.precision)
    fast = [fast_round(sim, models, cfg, 1) for _ in range(args.rounds)]
    m = fed.n_clients
    per = args.ref_clients // 4 if args.ref_clients else m // 4
    group = m // 4
    subset = np.concatenate([np.arange(g * group, g * group + per) for g in range(4)])
    ref = reference_round(model, fed, models, subset, cfg.train.lr, cfg.train.steps)
    scale = m / len(subset)
    # Same round from the same models: in fp32 the reference on its subset must match
    # the simulator's choices and, when it ran on all clients, its cluster models
    # (bf16 products may flip near-ties: the count is reported).
    other_choices = int((ref["choice"] != fast[0]["choice"][subset]).sum())
    fp32 = args.precision == "fp32"
    assert other_choices == 0 or not fp32, "choices differ"
    diff = None
    if len(subset) == m:
        diff = float((ref["models"] - fast[0]["models"]).abs().max())
        assert diff <= 1e-3 or not fp32, f"cluster models differ by {diff}"
    keys = ("choice_s", "train_s", "aggregate_s", "evaluate_s", "round_s")
    sim_t = {k: statistics.median(f[k] for f in fast) for k in keys}
    ref_t = {k: ref[k] * scale for k in keys}
    out = {
        "machine": machine_info(),
        "clients": m,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "precision": args.precision,
        "bf16_products": sim.low is not None,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "simulator": sim_t,
        "reference_loop": ref_t,
        "reference_clients_timed": len(subset),
        "reference_scaled_by": scale,
        "speedup_round": ref_t["round_s"] / sim_t["round_s"],
        "max_model_difference": diff,
        "choices_other_than_reference": other_choices,
        "accuracy_after_round": fast[0]["accuracy"],
    }
    print(
        f"{m} clients, {out['threads']} threads, device {device}, {args.precision}, "
        f"load {load_before} -> {out['loadavg_after']}"
    )
    print(f"{'part':<12}{'simulator s':>14}{'IFCA-style loop s':>20}{'ratio':>8}")
    for k in keys:
        print(f"{k[:-2]:<12}{sim_t[k]:>14.3f}{ref_t[k]:>20.3f}{ref_t[k] / sim_t[k]:>8.1f}")
    if scale != 1:
        print(f"(loop timed on {len(subset)} clients, scaled by {scale:.1f})")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
