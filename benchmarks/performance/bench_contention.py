"""A round under load: quiet vs one competing CPU-bound process.

The round of ``bench_round.py`` (FedAvg on JGL's setting: 80 clients x 200 MNIST
samples, MLP 784-512-128-10, B = 32, one epoch, ``Simulator.train`` + the
weighted average), timed in one process: ``--rounds`` rounds with no competitor
(median), then the same rounds while ``python -c "while True: pass"`` runs
(median), and their ratio (goal: <= 2.5x). With ``--policies`` each OpenMP wait
policy (PASSIVE, fedcluster's default, and ACTIVE) runs in its own child
process, since OpenMP reads ``OMP_WAIT_POLICY`` only when it starts.

"Quiet" is only as quiet as the machine: the load average (``os.getloadavg``)
and the CPU share other processes used during each round (``/proc``) are
printed beside the times.

Run from the repository root::

    python -m benchmarks.performance.bench_contention --rounds 5 --policies --out contention.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import save_run
from benchmarks.performance.bench_round import (
    BATCH,
    LR,
    SEED,
    THREADS,
    build_workload,
    default_data_dir,
    measure,
    sim_round,
)
from fedcluster.algorithms.base import init_row
from fedcluster.engine.simulator import Simulator
from fedcluster.protocol.batches import LocalTraining

COMPETITOR = [sys.executable, "-c", "while True: pass"]


def timed_rounds(sim: Simulator, row: torch.Tensor, cfg: LocalTraining, rounds: int) -> list:
    """(seconds, foreign CPU share) of ``rounds`` rounds after one warm-up round."""
    sim_round(sim, row, cfg, 0)
    return [measure(lambda r=r: sim_round(sim, row, cfg, r + 1)) for r in range(rounds)]


def one_policy(args: argparse.Namespace) -> dict[str, Any]:
    """Quiet rounds, then the same rounds beside a competitor, in this process."""
    torch.set_num_threads(args.threads)
    fed, model = build_workload(Path(args.data_dir) if args.data_dir else default_data_dir())
    row = init_row(model, SEED, "init")
    cfg = LocalTraining(lr=LR, batch_size=BATCH, epochs=1)
    sim = Simulator(model, fed, seed=SEED)
    load_before = os.getloadavg()
    quiet = timed_rounds(sim, row, cfg, args.rounds)
    competitor = subprocess.Popen(COMPETITOR)
    try:
        time.sleep(0.5)
        loaded = timed_rounds(sim, row, cfg, args.rounds)
    finally:
        competitor.kill()
        competitor.wait()
    q = statistics.median(s for s, _ in quiet)
    lo = statistics.median(s for s, _ in loaded)
    return {
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "torch_threads": torch.get_num_threads(),
        "quiet_seconds": [s for s, _ in quiet],
        "quiet_foreign_share": [f for _, f in quiet],
        "loaded_seconds": [s for s, _ in loaded],
        "loaded_foreign_share": [f for _, f in loaded],
        "quiet_median": q,
        "loaded_median": lo,
        "ratio": lo / q,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=THREADS, help="torch.set_num_threads")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--policies", action="store_true", help="PASSIVE and ACTIVE, one child each")
    ap.add_argument("--json", action="store_true", help="print one JSON result line (child mode)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    if not args.policies:
        results = {os.environ.get("OMP_WAIT_POLICY", "unset"): one_policy(args)}
    else:
        results = {}
        child = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--policies"]
        for policy in ("PASSIVE", "ACTIVE"):
            env = {**os.environ, "OMP_WAIT_POLICY": policy}
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.performance.bench_contention",
                *child,
                "--json",
            ]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            results[policy] = json.loads(out.stdout.strip().splitlines()[-1])[policy]
    if args.json:
        print(json.dumps(results))
        return results
    print(f"{'policy':<10}{'quiet s':>10}{'loaded s':>10}{'ratio':>8}   load average before/after")
    for name, r in results.items():
        print(
            f"{name:<10}{r['quiet_median']:10.3f}{r['loaded_median']:10.3f}{r['ratio']:7.2f}x"
            f"   {r['load_average_before']} / {r['load_average_after']}"
        )
    print("goal: ratio <= 2.5x with one competing process")
    save_run(args.out, results, load_before, rounds=args.rounds)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
