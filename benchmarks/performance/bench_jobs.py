# ruff: noqa: E402  (the run-as-module shim below precedes the imports)
"""A 4-job compare sequentially and with ``--jobs N``: wall time and the same tables.

The quickstart preset's federation (24 rotated-MNIST clients of mnist5k, MLP
784-200-100-10), ``fedcluster compare --algorithms fedavg,ifca --seeds 2`` (4 jobs)
for ``--rounds`` rounds, run by the CLI once with one job at a time and once with
``--jobs N`` (``fedcluster.experiment.jobs``: N worker processes with their share of the CPUs).
Reports both wall times, their ratio, and whether ``metrics.csv``, ``clusters.csv``,
``events.csv`` and ``diagnostics.csv`` are equal but for the timing columns. Load
matters on a shared machine: ``os.getloadavg()`` is recorded; ``--repeat`` interleaves
the two variants.

    python benchmarks/performance/bench_jobs.py --jobs 2 --out jobs.json
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
import csv
import io
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.performance.bench_round import machine_info
from fedcluster.cli import main as cli
from fedcluster.experiment.metrics import TIMING_COLUMNS
from fedcluster.reproduce import save_json

TABLES = ("metrics.csv", "clusters.csv", "events.csv", "diagnostics.csv")


def _table(path: Path) -> list[list[str]]:
    rows = list(csv.reader(io.StringIO(path.read_text(), newline="")))
    timing = [i for i, name in enumerate(rows[0]) if name in TIMING_COLUMNS]
    return [[("" if i in timing else v) for i, v in enumerate(r)] for r in rows]


def compare(out: Path, rounds: int, jobs: int) -> float:
    """Wall seconds of the 4-job compare written to ``out``."""
    args = ["compare", "--algorithms", "fedavg,ifca", "--seeds", "2", "--rounds", str(rounds)]
    args += ["--out", str(out), "--quiet", "--no-report", "--jobs", str(jobs)]
    t0 = time.perf_counter()
    cli(args)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--repeat", type=int, default=1, help="interleaved repetitions")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    load_before = os.getloadavg()
    seconds: dict[str, list[float]] = {"sequential": [], "jobs": []}
    same = True
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeat):
            one, many = Path(tmp) / f"one{r}", Path(tmp) / f"many{r}"
            seconds["sequential"].append(compare(one, args.rounds, 1))
            seconds["jobs"].append(compare(many, args.rounds, args.jobs))
            same &= all(_table(one / t) == _table(many / t) for t in TABLES)
    sequential, parallel = (statistics.median(seconds[k]) for k in ("sequential", "jobs"))
    out = {
        "jobs": args.jobs,
        "rounds": args.rounds,
        "sequential_s": sequential,
        "jobs_s": parallel,
        "speedup": sequential / parallel,
        "all_s": seconds,
        "same_tables": same,
        "loadavg_before_after": [load_before, os.getloadavg()],
        "machine": machine_info(),
    }
    print(
        f"4-job compare, {args.rounds} rounds: sequential {sequential:.1f} s, --jobs {args.jobs} "
        f"{parallel:.1f} s ({out['speedup']:.2f}x); same tables {same}"
    )
    if args.out:
        save_json(Path(args.out), out)
    return out


if __name__ == "__main__":
    main()
