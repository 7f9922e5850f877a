"""Reproduction runs of the CFLGT, FedGroup and DCFL papers' main experiments.

Each experiment runs a preset over several seeds (every algorithm on the same
federation, initial model and seeds) and prints a table of mean ± std over
seeds; ``--out`` keeps the run directories and a JSON of the table.

    python -m benchmarks.reproduce cflgt-s1 --seeds 3 --out runs/repro
    python -m benchmarks.reproduce fedgroup-mnist --seeds 3 --out runs/repro
    python -m benchmarks.reproduce fedgroup-synthetic --seeds 3 --out runs/repro
    python -m benchmarks.reproduce dcfl-table1 --seeds 3 --out runs/repro
    python -m benchmarks.reproduce dcfl-table1-central --seeds 1 --out runs/repro
    python -m benchmarks.reproduce dcfl-table1-central-500 --seeds 1 --out runs/repro
    python -m benchmarks.reproduce dcfl-table2 --seeds 3 --out runs/repro
    python -m benchmarks.reproduce dcfl-fig5 --seeds 3 --out runs/repro
    python -m benchmarks.reproduce summarize --runs DIR[:SEEDS] [...] --last 10

``--first-seed K`` runs seeds K, K+1, ... (e.g. one seed per process), and
``summarize`` builds the table from run directories written that way.

Scores: ``final`` is the pooled test accuracy of the last round; ``max`` the
best over evaluated rounds (FedGroup's Table III); ``last-N`` the mean over
the evaluated rounds among the last N (CFLGT Table I: N = 20; FedGroup: 10);
``purity`` and ``ARI`` those of the last round's clusters against the true groups;
``clients final`` the mean ± std over clients of the last round's per-client
accuracy and ``clients average`` the same two values averaged over all
evaluated rounds (DCFL Tables I and II).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.common import mean_std, parser, run_setting, save_json
from fedcluster.report import format_table

Row = dict[str, object]


def _evaluated(rows: list[Row]) -> list[Row]:
    return [r for r in rows if not math.isnan(float(r["accuracy"]))]


def job_scores(rows: list[Row], last: int) -> dict[str, float]:
    """The scores of one job's metric rows (module docstring)."""
    done = _evaluated(rows)
    final_round = rows[-1]["round"]
    tail = [float(r["accuracy"]) for r in done if r["round"] > final_round - last]
    end = done[-1]
    return {
        "final": float(end["accuracy"]),
        "max": max(float(r["accuracy"]) for r in done),
        "last": float(np.mean(tail)),
        "client_mean": float(end["accuracy_mean"]),
        "client_std": float(end["accuracy_std"]),
        "avg_client_mean": float(np.mean([float(r["accuracy_mean"]) for r in done])),
        "avg_client_std": float(np.mean([float(r["accuracy_std"]) for r in done])),
        "purity": float(rows[-1]["purity"]),
        "ari": float(rows[-1]["ari"]),
        "n_clusters": float(rows[-1]["n_clusters"]),
        "epsilon": float(rows[-1]["epsilon"]),
        "seconds": float(sum(r["client_seconds"] + r["server_seconds"] for r in rows)),
    }


def score_table(jobs: list[Row], last: int, setting: str | None = None) -> list[Row]:
    """Mean ± std over seeds of each algorithm's scores."""
    table = []
    for alg in dict.fromkeys(j["algorithm"] for j in jobs):
        s = [job_scores(j["rows"], last) for j in jobs if j["algorithm"] == alg]

        def col(key: str, scale: float = 100.0, digits: int = 1, s=s) -> str:
            return mean_std([x[key] for x in s], scale, digits)

        row: Row = {} if setting is None else {"setting": setting}
        row |= {
            "algorithm": alg,
            "seeds": str(len(s)),
            "final acc %": col("final"),
            "max acc %": col("max"),
            f"last-{last} acc %": col("last"),
            "clients final": f"{col('client_mean', 1, 2)} (sd {col('client_std', 1, 2)})",
            "clients average": f"{col('avg_client_mean', 1, 2)} (sd {col('avg_client_std', 1, 2)})",
            "clusters": col("n_clusters", 1, 1),
            "purity": col("purity", 1, 2),
            "ARI": col("ari", 1, 2),
            "epsilon": col("epsilon", 1, 2),
            "train s": col("seconds", 1, 0),
        }
        table.append(row)
    return table


def _run(preset: str, sets: list[str], args, tag: str, last: int, setting=None) -> list[Row]:
    if args.first_seed:
        tag = f"{tag}-from-seed-{args.first_seed}"
    out = Path(args.out) / tag
    jobs = run_setting(preset, sets, args.seeds, out, args.data_dir, args.rounds, args.first_seed)
    return score_table(jobs, last, setting)


def cflgt_s1(args) -> list[Row]:
    """CFLGT Table I, scenario 1 on Fashion-MNIST, every round evaluated."""
    return _run("cflgt-s1", ["eval_every=1"], args, "cflgt-s1", 20)


def fedgroup_mnist(args) -> list[Row]:
    """FedGroup Table III (MNIST): max accuracy over rounds and mean of the last 10."""
    return _run("fedgroup-mnist", ["eval_every=1"], args, "fedgroup-mnist", 10)


def fedgroup_synthetic(args) -> list[Row]:
    """FedGroup Table III (Synthetic(1,1)-MCLR): max accuracy over rounds and last 10."""
    return _run("fedgroup-synthetic", ["eval_every=1"], args, "fedgroup-synthetic", 10)


def dcfl_table1(args) -> list[Row]:
    """DCFL Table I: DCFL vs CFL vs FedAvg, with the preset's (client-level) DP and without.

    Record-level DP-SGD runs in the Fig. 5 settings with DP.
    """
    table = []
    for mode in ("client", "none"):
        sets = ["eval_every=1", f"privacy.mode={mode}"]
        table += _run("dcfl-emnist-dynamic", sets, args, f"dcfl-t1-{mode}", 10, f"DP {mode}")
    return table


# DCFL Table I under central DP (docs/privacy.md): CFL clusters on individual updates and
# is refused there; DCFL clusters on noisy 256-dimensional sketches. With ~25 participants
# Andrew et al.'s σ_b = m/20 is below z/2 (Theorem 1 needs 2σ_b > z): σ_b = 6.
CENTRAL_MODES = {
    "central": ["privacy.mode=central", "algorithms=[{name: fedavg}]"],
    "sketch": ["privacy.mode=central", "privacy.sketch_dim=256", "algorithms=[{name: dcfl}]"],
}
CENTRAL_COMMON = ["eval_every=1", "privacy.count_noise=6"]


def dcfl_table1_central(args) -> list[Row]:
    """DCFL Table I under central DP: FedAvg (central) and DCFL (central with sketches)."""
    table = []
    for mode, sets in CENTRAL_MODES.items():
        sets = [*CENTRAL_COMMON, *sets]
        table += _run("dcfl-emnist-dynamic", sets, args, f"dcfl-t1-{mode}", 10, f"DP {mode}")
    return table


# The same setting with the clients central DP needs (the noise of a cluster mean is
# z·C·√d/n_k): 500 clients (495 from round 1, 5 newcomers) of 200 samples and multinomial
# logistic regression (d = 36,895 instead of the MLP's 182,347).
SCALED = [
    "data.partition.base_options={n_clients: 500, alpha: 1.0, samples_per_client: 200, "
    "test_fraction: 0.2}",
    "model.name=mclr",
    "model.options={}",
    "train.lr=0.1",
]


def dcfl_table1_central_500(args) -> list[Row]:
    """DCFL Table I scaled to 500 clients and MCLR: without DP, central and sketch."""
    table = []
    settings = {"none": ["privacy.mode=none", "algorithms=[{name: dcfl}, {name: fedavg}]"]}
    for mode, sets in (settings | CENTRAL_MODES).items():
        sets = [*CENTRAL_COMMON, *SCALED, *sets]
        table += _run("dcfl-emnist-dynamic", sets, args, f"dcfl-t1-500-{mode}", 10, f"DP {mode}")
    return table


def dcfl_table2(args) -> list[Row]:
    """DCFL Table II: DCFL's distance ablation (without DP, see docs)."""
    algorithms = (
        "["
        + ", ".join(
            f"{{name: dcfl, label: dcfl-{v}, params: {{variant: {v}}}}}"
            for v in ("complete", "divergence", "cosine", "euclidean")
        )
        + "]"
    )
    sets = ["eval_every=1", "privacy.mode=none", f"algorithms={algorithms}"]
    return _run("dcfl-emnist-dynamic", sets, args, "dcfl-t2", 10)


# Fig. 5's second setting (newcomers, drift, no DP) is dcfl-table1's "DP none" run.
FIG5 = {
    "static, no DP": ["scenario.joins={}", "scenario.drift=[]", "privacy.mode=none"],
    "newcomers, no drift, DP": ["scenario.drift=[]", "privacy.mode=record"],
    "no newcomers, drift, DP": ["scenario.joins={}", "privacy.mode=record"],
}


def dcfl_fig5(args) -> list[Row]:
    """DCFL Fig. 5: DCFL, CFL and FedAvg in four combinations of newcomers, drift and DP."""
    table = []
    for i, (name, sets) in enumerate(FIG5.items()):
        sets = ["eval_every=1", *sets]
        table += _run("dcfl-emnist-dynamic", sets, args, f"dcfl-f5-{i}", 10, name)
    return table


def load_jobs(runs: list[str]) -> list[Row]:
    """Jobs (algorithm, seed, metric rows) read back from run directories' ``metrics.csv``.

    A run given as ``DIR:0,1`` contributes only seeds 0 and 1.
    """
    jobs: dict[tuple[str, int], list[Row]] = {}
    for run in runs:
        run_dir, _, only = run.partition(":")
        seeds = {int(s) for s in only.split(",")} if only else None
        with open(Path(run_dir) / "metrics.csv", newline="") as f:
            for r in csv.DictReader(f):
                if seeds is not None and int(r["seed"]) not in seeds:
                    continue
                row: Row = {
                    k: float(v) if v else math.nan for k, v in r.items() if k != "algorithm"
                }
                row["round"] = int(r["round"])
                jobs.setdefault((r["algorithm"], int(r["seed"])), []).append(row)
    return [{"algorithm": a, "seed": s, "rows": rows} for (a, s), rows in jobs.items()]


EXPERIMENTS: dict[str, Callable] = {
    "cflgt-s1": cflgt_s1,
    "fedgroup-mnist": fedgroup_mnist,
    "fedgroup-synthetic": fedgroup_synthetic,
    "dcfl-table1": dcfl_table1,
    "dcfl-table1-central": dcfl_table1_central,
    "dcfl-table1-central-500": dcfl_table1_central_500,
    "dcfl-table2": dcfl_table2,
    "dcfl-fig5": dcfl_fig5,
}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("experiment", choices=[*sorted(EXPERIMENTS), "summarize"])
    p.add_argument("--runs", nargs="*", default=[], help="summarize: run directories [DIR:SEEDS]")
    p.add_argument("--last", type=int, default=10, help="summarize: N of the last-N score")
    args = p.parse_args()
    if args.experiment == "summarize":
        table = score_table(load_jobs(args.runs), args.last)
    else:
        table = EXPERIMENTS[args.experiment](args)
    save_json(Path(args.out) / f"{args.experiment}.json", table)
    print(format_table(table))


if __name__ == "__main__":
    main()
