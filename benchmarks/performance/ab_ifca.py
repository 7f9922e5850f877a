"""IFCA's 2,400-client round parts at two code versions, interleaved in one process.

The round of ``bench_ifca.py`` (K = 4 choice on all training data, full-batch
training from each client's chosen model, own-loss evaluation; the aggregation
is left out) on ``Simulator`` and ``MLPKernel`` of a git revision (``--rev``) and
of the working tree, alternating their order round by round, both with two fixed
worker threads (the adaptive count would give either version one worker under
load). Only ratios within one run mean anything on a shared machine
(docs/benchmarks.md); the first round, which fills each simulator's Gram cache
and finds the distinct test sets, is reported apart from the median of the others.

    python -m benchmarks.performance.ab_ifca --rev main --precision bf16 --rounds 5

The revision's ``simulator.py``, ``mlp_kernel.py`` and ``model_eval.py`` are
loaded beside the working tree's (everything else comes from the working tree,
so the interfaces between them must agree); ``--group-size`` fixes the working
tree's group size (default: its own rule), ``--compare-group-size`` makes the
other side the working tree with that group size instead of the revision.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.performance.ab_round import FILES, load_revision
from benchmarks.performance.bench_ifca import build
from fedcluster.engine.flat import ParamLayout
from fedcluster.engine.simulator import Simulator
from fedcluster.models import build_model
from fedcluster.protocol.batches import LocalTraining

PARTS = ("choice", "train", "eval", "round")


def timed_round(sim: Simulator, models: torch.Tensor, cfg: LocalTraining) -> dict[str, float]:
    clients = np.arange(sim.federation.n_clients)
    t0 = time.perf_counter()
    _, _, losses = sim.evaluate_models(clients, models, split="train")
    t1 = time.perf_counter()
    sim.train(clients, models[losses.argmin(axis=1)], cfg, 1)
    t2 = time.perf_counter()
    sim.evaluate_models(clients, models, split="test")
    t3 = time.perf_counter()
    return {"choice": t1 - t0, "train": t2 - t1, "eval": t3 - t2, "round": t3 - t0}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rev", default="HEAD")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clients-per-group", type=int, default=600)
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--compare-group-size", type=int, default=None)
    p.add_argument("--data-dir", default=os.environ.get("FEDCLUSTER_DATA", "../shared/data"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    fed, cfg = build(args.clients_per_group, args.data_dir)
    model = build_model("mlp", fed.input_shape, fed.n_classes, hidden=[200])
    layout = ParamLayout(model)
    torch.manual_seed(0)
    models = torch.stack(
        [layout.flatten(build_model("mlp", fed.input_shape, 10, hidden=[200])) for _ in range(4)]
    )
    train = LocalTraining(**cfg.train.model_dump(exclude={"loss"}))
    common = {"seed": 0, "precision": args.precision, "threads": 2}
    with tempfile.TemporaryDirectory(prefix="ab_ifca_") as tmp:
        if args.compare_group_size:
            other = f"working tree, groups of {args.compare_group_size}"
            old = Simulator(model, fed, group_size=args.compare_group_size, **common)
        else:
            other = args.rev
            files = FILES | {"model_eval": "src/fedcluster/engine/model_eval.py"}
            mods = load_revision(args.rev, Path(tmp), files)
            sim_mod = mods["simulator"]
            sim_mod.MLPKernel = mods["kernel"].MLPKernel
            sim_mod.chunk_stats = mods["model_eval"].chunk_stats
            sim_mod.distinct_chunks = mods["model_eval"].distinct_chunks
            old = sim_mod.Simulator(model, fed, **common)
            old.kernel.__class__ = mods["kernel"].MLPKernel
        sims = {
            other: old,
            "working tree": Simulator(model, fed, group_size=args.group_size, **common),
        }
        load_before = os.getloadavg()
        seconds = {name: {k: [] for k in PARTS} for name in sims}
        names = list(sims)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                for k, v in timed_round(sims[name], models, train).items():
                    seconds[name][k].append(round(v, 4))
    out = {
        "clients": fed.n_clients,
        "precision": args.precision,
        "rev": other,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "seconds": seconds,
    }
    print(
        f"{fed.n_clients} clients, {args.precision}, load {load_before} -> {out['loadavg_after']}"
    )
    for k in PARTS:
        a, b = (statistics.median(seconds[n][k][1:]) for n in names)
        fa, fb = (seconds[n][k][0] for n in names)
        print(
            f"{k:<7} median of rounds 2+: {a:.3f} -> {b:.3f} s ({b / a:.3f}); "
            f"first round {fa:.3f} -> {fb:.3f} s ({fb / fa:.3f})"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
