# ruff: noqa: E402  (the run-as-module shim below precedes the imports)
"""IFCA's 2,400-client rotated-MNIST round in one process and over distributed workers.

The workload of ``bench_ifca.py`` (the preset ``ifca-rotated-mnist``: 4 rotation
groups of 600 clients, 100 MNIST images each, MLP 784-200-10, K = 4, 10
full-batch steps; Ghosh et al. 2020), run as the runner runs it: IFCA's
``run_round`` (every client's choice among the K models, local training,
the per-cluster average) and its evaluation, through a backend:

- ``1 process``: the batched simulator, ``--threads`` torch threads (default: all CPUs);
- ``N workers``: ``backend: distributed`` (fedcluster.experiment.distributed), the clients
  sharded over N worker processes on this machine (gloo over 127.0.0.1), each with
  its share of the CPUs; the driver keeps the algorithm and the channel.

Both start from the same models and run their rounds interleaved (one round of
each in turn, so both see the same machine load); the script checks that they end
with the same cluster models and assignments, then reports seconds per round
(median of ``--rounds`` timed rounds after one warm-up round) and the ratio. Load matters on a
shared machine: compare only ratios from one run (``os.getloadavg()`` is recorded).

    python benchmarks/performance/bench_workers.py --workers 2 --out workers.json
    python benchmarks/performance/bench_workers.py --clients-per-group 60 --rounds 2  # quick
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
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.performance.bench_ifca import build
from benchmarks.performance.bench_round import default_data_dir, machine_info
from fedcluster.algorithms import algorithm_class, algorithm_params
from fedcluster.algorithms.base import Context, init_row
from fedcluster.experiment.distributed import DistributedFactory
from fedcluster.experiment.runner import simulator_for
from fedcluster.models import build_model
from fedcluster.protocol.backend import Backend
from fedcluster.protocol.batches import LocalTraining
from fedcluster.reproduce import save_json


class Rounds:
    """IFCA's rounds (and evaluations) through one backend, one at a time."""

    def __init__(self, backend: Backend, cfg) -> None:
        train = LocalTraining(**cfg.train.model_dump(exclude={"loss"}))
        self.ctx = Context.for_backend(backend, train, 0, init_row(backend.model, 0, "init"))
        spec = cfg.algorithms[0]
        self.algorithm = algorithm_class(spec.name)(algorithm_params(spec), self.ctx)
        self.state = self.algorithm.init_state()
        self.clients = np.arange(backend.federation.n_clients)
        self.seconds: list[float] = []
        self.accuracy = float("nan")

    def next(self, rnd: int) -> None:
        self.ctx.channel.start_round()
        t0 = time.perf_counter()
        self.algorithm.run_round(self.state, rnd, self.clients)
        result = self.algorithm.evaluate(self.state, rnd)
        self.seconds.append(time.perf_counter() - t0)
        self.accuracy = float(result.correct.sum() / result.count.sum())

    def summary(self) -> dict:
        return {
            "round_s": statistics.median(self.seconds[1:]),  # round 1 warms up
            "rounds_s": self.seconds,
            "accuracy": self.accuracy,
            "models": self.state.models.clone(),
            "assign": self.algorithm.clusters(self.state),
        }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients-per-group", type=int, default=600)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (median)")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the 1 process")
    p.add_argument("--data-dir", default=str(default_data_dir()))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(args.threads or cores)
    fed, cfg = build(args.clients_per_group, args.data_dir)
    cfg = cfg.model_copy(update={"backend": "distributed", "workers": args.workers})
    model = build_model(cfg.model.name, fed.input_shape, fed.n_classes, **cfg.model.options)
    load_before = os.getloadavg()
    factory = DistributedFactory(cfg)
    t0 = time.perf_counter()
    backend = factory.backend(model, fed, 0)  # starts the workers, sends the shards
    start_s = time.perf_counter() - t0
    try:
        rounds = Rounds(simulator_for(cfg, model, fed, 0), cfg), Rounds(backend, cfg)
        for rnd in range(1, args.rounds + 2):  # interleaved: both see the same load
            for variant in rounds:
                variant.next(rnd)
        one, many = (variant.summary() for variant in rounds)
    finally:
        factory.close()
    same_models = bool(torch.equal(one["models"], many["models"]))
    same_assign = bool(np.array_equal(one["assign"], many["assign"]))
    out = {
        "clients": fed.n_clients,
        "workers": args.workers,
        "threads_one_process": torch.get_num_threads(),
        "threads_per_worker": max(1, cores // args.workers),
        "one_process_round_s": one["round_s"],
        "workers_round_s": many["round_s"],
        "speedup": one["round_s"] / many["round_s"],
        "workers_start_s": start_s,
        "rounds_s": {"one": one["rounds_s"], "workers": many["rounds_s"]},
        "accuracy": {"one": one["accuracy"], "workers": many["accuracy"]},
        "same_models": same_models,
        "same_assignments": same_assign,
        "loadavg_before_after": [load_before, os.getloadavg()],
        "machine": machine_info(),
    }
    print(
        f"IFCA round, {fed.n_clients} clients: 1 process {one['round_s']:.3f} s, "
        f"{args.workers} workers {many['round_s']:.3f} s ({out['speedup']:.2f}x; workers "
        f"started in {start_s:.1f} s); same models {same_models}, same assignments {same_assign}"
    )
    if args.out:
        save_json(Path(args.out), out)
    return out


if __name__ == "__main__":
    main()
