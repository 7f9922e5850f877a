"""One table across datasets from several leaderboards (``fedcluster benchmark``'s
``leaderboard.json``): per scenario and dataset, FedAvg, local training and the best
methods with their mean accuracy and ARI over seeds, and which methods are not
significantly worse than the best (paired t-test p ≥ 0.05 on their common seeds).

    python -m benchmarks.reproduction.leaderboard_summary \\
        mnist=runs/shift-mnist fmnist=runs/shift-fmnist cifar10=runs/shift-cifar10
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedcluster.experiment.summary import format_table

TOP = 3
"""Methods named per cell, best first."""


def method_text(row: dict) -> str:
    ari = "" if row["ari"] is None else f", ARI {row['ari']:.2f}"
    return f"{row['method']} {100 * row['mean']:.1f}{ari}"


def summary_rows(boards: dict[str, list[dict]]) -> list[dict[str, str]]:
    """One row per (scenario, dataset), scenarios in the first leaderboard's order."""
    out = []
    scenarios = list(dict.fromkeys(r["scenario"] for rows in boards.values() for r in rows))
    for scenario in scenarios:
        for dataset, rows in boards.items():
            here = sorted((r for r in rows if r["scenario"] == scenario), key=lambda r: -r["mean"])
            if not here:
                continue
            by_name = {r["method"]: r for r in here}
            tied = [
                r["method"]
                for r in here
                if r["best"] or (r["p_vs_best"] is not None and r["p_vs_best"] >= 0.05)
            ]
            out.append(
                {
                    "scenario": scenario,
                    "dataset": dataset,
                    "fedavg %": f"{100 * by_name['fedavg']['mean']:.1f}",
                    "local %": f"{100 * by_name['local']['mean']:.1f}",
                    "best methods (accuracy %, ARI)": "; ".join(method_text(r) for r in here[:TOP]),
                    "not worse than the best (p ≥ 0.05)": str(len(tied)),
                }
            )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("boards", nargs="+", help="NAME=DIR: a benchmark's --out directory")
    args = p.parse_args()
    boards = {}
    for item in args.boards:
        name, _, folder = item.partition("=")
        boards[name] = json.loads((Path(folder) / "leaderboard.json").read_text())["rows"]
    print(format_table(summary_rows(boards)))


if __name__ == "__main__":
    main()
