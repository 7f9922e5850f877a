"""The round benchmark's simulator round at two code versions, interleaved in one process.

On a shared machine only ratios measured in one run mean anything
(docs/benchmarks.md), and two separate runs of ``bench_round.py`` meet different
loads. This script loads ``engine/simulator.py`` and ``engine/mlp_kernel.py`` of a
git revision (``--rev``, default ``HEAD``) beside the working tree's and times the
same rounds of both (JGL setting of ``bench_round.py``: 80 clients x 200 MNIST
samples, MLP 784-512-128-10, B = 32, one epoch, then the weighted average),
alternating their order round by round, optionally with the plain loop. It first
checks that both train bit-identical rows, from the shared start and from 80
distinct starts, and reports the matmul peak measured in the same process
(start and end, best kept) and the roofline fraction of each.

Run from the repository root::

    python -m benchmarks.performance.ab_round --rev HEAD~1 --rounds 16 --plain --out ab.json

The revision's simulator imports everything else from the working tree, so the
two versions must agree on the interfaces between ``simulator.py`` and the rest.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from benchmarks.performance.bench_round import (
    BATCH,
    LR,
    SEED,
    THREADS,
    build_workload,
    default_data_dir,
    linear_dims,
    machine_info,
    matmul_peak,
    plain_round,
    round_flops,
    sim_round,
)
from fedcluster.algorithms.base import init_row
from fedcluster.engine.simulator import Simulator
from fedcluster.protocol.batches import LocalTraining

REPO = Path(__file__).resolve().parents[2]
FILES = {
    "simulator": "src/fedcluster/engine/simulator.py",
    "kernel": "src/fedcluster/engine/mlp_kernel.py",
}


def load_revision(rev: str, workdir: Path, files: dict[str, str] = FILES) -> dict[str, ModuleType]:
    """``files`` (default: ``simulator.py`` and ``mlp_kernel.py``) as of ``rev``, as
    modules of their own."""
    modules = {}
    for name, path in files.items():
        text = subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout
        file = workdir / f"ab_{name}.py"
        file.write_text(text)
        spec = importlib.util.spec_from_file_location(f"ab_{name}", file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
        modules[name] = module
    return modules


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="HEAD", help="git revision to compare the working tree with")
    ap.add_argument("--rounds", type=int, default=12, help="timed rounds per version")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=THREADS, help="worker threads (fixed)")
    ap.add_argument("--plain", action="store_true", help="also time the plain nn.Module loop")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(THREADS)
    load_before = os.getloadavg()
    fed, model = build_workload(args.data_dir or default_data_dir())
    row = init_row(model, SEED, "init")
    cfg = LocalTraining(lr=LR, batch_size=BATCH, epochs=1)
    flops = round_flops(fed, linear_dims(model))["total"]
    with tempfile.TemporaryDirectory(prefix="ab_round_") as tmp:
        old = load_revision(args.rev, Path(tmp))
        sims = {
            args.rev: old["simulator"].Simulator(
                model, fed, seed=SEED, group_size=args.group_size, threads=args.threads
            ),
            "working tree": Simulator(
                model, fed, seed=SEED, group_size=args.group_size, threads=args.threads
            ),
        }
        kernel = sims[args.rev].kernel
        if kernel is not None:
            kernel.__class__ = old["kernel"].MLPKernel

        clients = np.arange(fed.n_clients)
        own = row + 0.01 * torch.randn(
            len(clients), row.numel(), generator=torch.Generator().manual_seed(0)
        )
        identical = {}
        for label, start in (("shared_start", row), ("own_starts", own)):
            a, b = (s.train(clients, start, cfg, 3).rows for s in sims.values())
            identical[label] = torch.equal(a, b)
        print(f"trained rows bit-identical: {identical}")

        runs = {
            name: (lambda rnd, s=sim: sim_round(s, row, cfg, rnd)) for name, sim in sims.items()
        }
        if args.plain:
            runs["plain loop"] = lambda rnd: plain_round(model, fed, row, cfg, rnd)
        peaks = [matmul_peak()["gflops"]]
        for run in runs.values():  # warm-up
            run(1)
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        names = list(runs)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                t = time.perf_counter()
                runs[name](2 + r)
                seconds[name].append(time.perf_counter() - t)
        peaks.append(matmul_peak()["gflops"])
    peak = max(peaks)
    median = {k: statistics.median(v) for k, v in seconds.items()}
    fastest = {k: min(v) for k, v in seconds.items()}
    roofline_s = flops / (peak * 1e9)
    for name in runs:
        print(
            f"{name:<14} median {median[name]:.4f}s  min {fastest[name]:.4f}s  roofline "
            f"{roofline_s / median[name]:.1%} (median) {roofline_s / fastest[name]:.1%} (min)"
        )
    new, base = median["working tree"], median[args.rev]
    print(f"working tree / {args.rev}: {new / base:.3f} (medians); peak {peak:.1f} GFLOP/s")
    if args.plain:
        print(f"plain loop / working tree: {median['plain loop'] / new:.2f}x")
    result = {
        "machine": machine_info(),
        "rev": args.rev,
        "threads": args.threads,
        "group_size": args.group_size,
        "env": {k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")},
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "rows_bit_identical": identical,
        "matmul_peak_runs_gflops": peaks,
        "round_flops": flops,
        "roofline_seconds": roofline_s,
        "seconds": seconds,
        "median": median,
        "min": fastest,
        "roofline_fraction_median": {k: roofline_s / v for k, v in median.items()},
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
