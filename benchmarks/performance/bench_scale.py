"""Federations of 1,000 to 10,000 clients: time per round by step, peak memory.

FedAvg, IFCA, FedGroup (EDC + k-means++) and DCFL (eq. 2 +
affinity propagation, sampled above 500 participants; ``dcfl-exact``: never
sampled) run ``--rounds`` rounds on a synthetic clustered
federation of n clients (``--sizes``, default 1k, 3k, 10k): 4 hidden groups,
each with its own linear labelling rule (FedProx's Synthetic construction,
:mod:`fedcluster.data.synthetic`, with one rule per group), 20-100 training and
10 test samples per client, ``--features`` inputs, 10 classes; MCLR (or
``--model mlp``: 784-200-10 with ``--features 784``); 10% of the clients per
round (``--participation``), B = 10, lr 0.1, one local epoch.

Per round it reports, from the runner's metrics rows: client time (the
simulator's clock), server time, evaluation time; and, by wrapping the
functions the algorithms call, the server's time in clustering (pairwise
distances, affinity propagation, SVD, k-means, Dunn index) and in aggregation
(weighted and per-cluster averages), in total and round by round (round 1
holds FedGroup's one-off cold start; the printed line gives clustering's share
of round 1 and of the later rounds). Every (size, algorithm) runs in its own
child process, whose peak resident set size (``resource.getrusage``, which
includes the federation's data) is reported.

Goals: 10k clients in <= 8 GB; per-round time linear in the
participating clients; clustering at 1k clients <= 10% of the round.

Run from the repository root::

    python -m benchmarks.performance.bench_scale --sizes 1000,3000,10000 --rounds 3 --out scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import save_run
from fedcluster.config.schema import resolve_config
from fedcluster.data.federation import Federation
from fedcluster.experiment.callbacks import Callback, JobInfo
from fedcluster.experiment.runner import Experiment
from fedcluster.rng import numpy_rng

ALGORITHMS = {
    "fedavg": {"name": "fedavg"},
    "ifca": {"name": "ifca", "params": {"n_clusters": 4}},
    "fedgroup": {"name": "fedgroup", "params": {"n_groups": 4, "measure": "edc"}},
    "dcfl": {"name": "dcfl"},
    # DCFL without its sampled clustering above 500 participants (max_exact_participants)
    "dcfl-exact": {
        "name": "dcfl",
        "label": "dcfl-exact",
        "params": {"max_exact_participants": None},
    },
}
STEPS = {
    "clustering": {
        "fedcluster.algorithms.dcfl": [
            "dcfl_distance_matrix",
            "dcfl_distance_to",
            "affinity_propagation_exemplars",
            "dunn_index",
        ],
        "fedcluster.algorithms.fedgroup": [
            "cosine_to",
            "svd_directions",
            "kmeans_pp",
            "hierarchical",
            "madc_matrix",
        ],
    },
    # every algorithm averages through the run's Aggregator, which calls this function
    "aggregation": {"fedcluster.algorithms.robust": ["aggregate"]},
}
N_GROUPS, N_CLASSES, TEST_SIZE = 4, 10, 10


def clustered_federation(
    n_clients: int, n_features: int, seed: int, sizes: tuple[int, int] = (20, 100)
) -> Federation:
    """n clients in 4 groups; group g labels x ~ N(0, I) by argmax(x W_g + b_g)."""
    rng = numpy_rng(seed, "bench/scale")
    w = rng.normal(size=(N_GROUPS, n_features, N_CLASSES)) / np.sqrt(n_features)
    b = rng.normal(size=(N_GROUPS, N_CLASSES))
    groups = np.arange(n_clients) % N_GROUPS
    n_train = rng.integers(sizes[0], sizes[1] + 1, size=n_clients)
    total = n_train + TEST_SIZE
    x = rng.normal(size=(int(total.sum()), n_features)).astype(np.float32)
    owner = np.repeat(np.arange(n_clients), total)
    g = groups[owner]
    y = np.empty(len(x), dtype=np.int64)
    for k in range(N_GROUPS):  # group by group: no [N, f, classes] intermediate
        rows = g == k
        y[rows] = np.argmax(x[rows] @ w[k] + b[k], axis=1)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    starts = np.concatenate([[0], np.cumsum(total)])
    train, test = [], []
    for c in range(n_clients):
        s, m = int(starts[c]), int(n_train[c])
        train.append((xt[s : s + m], yt[s : s + m]))
        test.append((xt[s + m : s + m + TEST_SIZE], yt[s + m : s + m + TEST_SIZE]))
    return Federation.from_clients(train, test, N_CLASSES, groups)


def _timed(fn: Callable, bucket: dict[str, float], step: str) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t
            bucket[step] += dt
            bucket[f"{step}/{fn.__name__}"] += dt

    return wrapper


def instrument() -> dict[str, float]:
    """Wrap the algorithms' clustering and aggregation functions with timers."""
    import importlib

    bucket: dict[str, float] = defaultdict(float)
    for step, modules in STEPS.items():
        for module_name, names in modules.items():
            module = importlib.import_module(module_name)
            for name in names:
                setattr(module, name, _timed(getattr(module, name), bucket, step))
    return bucket


class StepSecondsPerRound(Callback):
    """The timed steps' seconds of each round, from the cumulative ``bucket``."""

    def __init__(self, bucket: dict[str, float], steps: tuple[str, ...]) -> None:
        self.bucket = bucket
        self.seen = {step: 0.0 for step in steps}
        self.per_round: dict[str, list[float]] = {f"{step}_seconds": [] for step in steps}

    def on_round_end(self, job: JobInfo, rnd: int, row: dict[str, Any], state: Any) -> None:
        for step, before in self.seen.items():
            self.per_round[f"{step}_seconds"].append(self.bucket[step] - before)
            self.seen[step] = self.bucket[step]


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One algorithm on one federation size in this process."""
    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    fed = clustered_federation(args.child_size, args.features, seed=0)
    build_s = time.perf_counter() - t
    model = (
        {"name": "mclr"} if args.model == "mclr" else {"name": "dnn", "options": {"hidden": 200}}
    )
    overrides = {
        "name": f"scale-{args.child_size}",
        "rounds": args.rounds,
        "model": model,
        "train": {"lr": 0.1, "batch_size": 10, "epochs": 1},
        "participation": {"fraction": args.participation, "count": None},
        "algorithms": [ALGORITHMS[args.child_algorithm]],
        "eval_every": args.rounds,
        "checkpoint_every": 10**6,
    }
    config = resolve_config(None, "fedgroup-mnist", [], overrides)  # its model has no options
    bucket = instrument()
    steps = StepSecondsPerRound(bucket, tuple(STEPS))
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
        t = time.perf_counter()
        jobs = Experiment(config, federation=fed, callbacks=[steps]).run(Path(tmp), progress=False)
        wall = time.perf_counter() - t
    rows = jobs[0].rows
    per_round = {
        k: [float(r[k]) for r in rows if k in r]
        for k in ("client_seconds", "server_seconds", "eval_seconds")
    } | steps.per_round
    rounds = len(rows)
    return {
        "clients": args.child_size,
        "algorithm": args.child_algorithm,
        "participants_per_round": int(round(args.participation * args.child_size)),
        "rounds": rounds,
        "build_seconds": build_s,
        "run_seconds": wall,
        "per_round": per_round,
        "clustering_seconds_total": bucket["clustering"],
        "aggregation_seconds_total": bucket["aggregation"],
        "seconds_total_by_function": {k: v for k, v in bucket.items() if "/" in k},
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "final_accuracy": rows[-1].get("accuracy"),
        "final_purity": rows[-1].get("purity"),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,3000,10000")
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--participation", type=float, default=0.1)
    ap.add_argument("--model", choices=("mclr", "mlp"), default="mclr")
    ap.add_argument("--features", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per child")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child-size", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-algorithm", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_size is not None:
        print(json.dumps(child(args)))
        return []
    base = [a for a in (argv if argv is not None else sys.argv[1:])]
    results: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    for size in (int(s) for s in args.sizes.split(",")):
        for algo in args.algorithms.split(","):
            cmd = [sys.executable, "-m", "benchmarks.performance.bench_scale", *base]
            cmd += ["--child-size", str(size), "--child-algorithm", algo]
            try:
                out = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=args.timeout, check=True
                )
                res = json.loads(out.stdout.strip().splitlines()[-1])
            except subprocess.TimeoutExpired:
                res = {"clients": size, "algorithm": algo, "error": f"timeout {args.timeout}s"}
            except subprocess.CalledProcessError as exc:
                tail = exc.stderr.strip().splitlines()[-1:] if exc.stderr else []
                res = {"clients": size, "algorithm": algo, "error": f"rc {exc.returncode} {tail}"}
            results.append(res)
            print(_line(res), flush=True)
    load_after = os.getloadavg()
    print(f"load average before/after {load_before} / {load_after}")
    save_run(args.out, results, load_before, argv=base)
    return results


def clustering_shares(r: dict[str, Any]) -> tuple[float | None, float | None]:
    """Clustering's share of round 1 (FedGroup's cold start, DCFL's first clustering)
    and of the later rounds together; ``None`` where the rounds were not recorded."""
    per = r["per_round"]
    if "clustering_seconds" not in per or not per["clustering_seconds"]:
        return None, None
    clus = np.asarray(per["clustering_seconds"])
    total = np.asarray(per["client_seconds"]) + np.asarray(per["server_seconds"])
    first = float(clus[0] / max(total[0], 1e-12))
    later = float(clus[1:].sum() / max(total[1:].sum(), 1e-12)) if len(clus) > 1 else None
    return first, later


def _line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['clients']:>6} {r['algorithm']:<9} {r['error']}"
    n = max(1, r["rounds"])
    client = np.mean(r["per_round"]["client_seconds"])
    server = np.mean(r["per_round"]["server_seconds"])
    clus = r["clustering_seconds_total"] / n
    agg = r["aggregation_seconds_total"] / n
    share = clus / max(client + server, 1e-12)
    first, later = clustering_shares(r)
    split = ""
    if first is not None:
        later_part = "" if later is None else f", later rounds {later:5.1%}"
        split = f" (round 1 {first:5.1%}{later_part})"
    parts = sorted(r.get("seconds_total_by_function", {}).items(), key=lambda kv: -kv[1])
    top = ", ".join(f"{k.split('/')[1]} {v / n:.3f}s" for k, v in parts[:3] if v / n >= 0.001)
    return (
        f"{r['clients']:>6} {r['algorithm']:<9} client {client:7.3f}s  server {server:7.3f}s  "
        f"(clustering {clus:7.3f}s = {share:5.1%} of the round{split}, "
        f"aggregation {agg:6.3f}s)  "
        f"eval {np.mean(r['per_round']['eval_seconds'] or [0]):6.3f}s  "
        f"peak RSS {r['peak_rss_mb']:7.0f} MB  accuracy {r['final_accuracy']}  "
        f"purity {r.get('final_purity')}" + (f"  [{top}]" if top else "")
    )


if __name__ == "__main__":
    main(sys.argv[1:])
