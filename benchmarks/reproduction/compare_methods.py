"""The recent clustered methods (PACFL, FedSoft, FedEM, WeCFL) against IFCA,
FedGroup, DCFL and FedAvg (the floor) on three small federations, seeds 0..N-1.

The preset ``compare-cfl`` (16 clients in 4 groups, 100 training samples each, an
MLP 784-64-10, 15 rounds) in three settings:

- ``rotated-mnist``: mnist5k in 4 rotation groups (0/90/180/270 degrees), the
  quickstart's federation at a quarter of its size;
- ``rotated-fmnist``: the same on Fashion-MNIST (25 test samples per client from
  its test split);
- ``label-skew``: mnist5k, unrotated, 4 groups each holding 5 of the 10 digits
  (0-4, 5-9, the even and the odd ones: every digit in two groups), 25 samples of
  each of its digits per client (``cluster_table``, 20% held out for the test).

FedEM runs twice: at the preset's learning rate and at M = 4 times it
(``fedem-lr×4``), as its reference code tunes it (docs/reproduction.md, "The
clustered methods of today"). Writes ``compare_methods.json`` (every job's summary
and the table) and ``compare_methods.md`` (the table) under ``--out``:

    nice python -m benchmarks.reproduction.compare_methods --seeds 3 --out runs/compare
    nice python -m benchmarks.reproduction.compare_methods --settings label-skew --out runs/compare

``--settings`` runs a subset (e.g. one per process); ``summarize`` rebuilds the
table from the JSON files that such runs wrote into ``--out``.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.common import parser
from fedcluster.reproduce import chosen_settings, mean_std, run_setting, write_results

PRESET = "compare-cfl"
FEDEM_LR_FACTOR = 4  # M components (module docstring)

_SKEW_TABLE = [
    [int(str(c) in held) for c in range(10)] for held in ("01234", "56789", "02468", "13579")
]
"""Label skew: which digits each of the 4 groups holds (1: 25 samples per client)."""

SETTINGS: dict[str, list[str]] = {
    "rotated-mnist": [],
    "rotated-fmnist": [
        "data.dataset=fashion-mnist",
        "data.partition.base_options={n_clients: 16, samples_per_client: 100, test_size: 25}",
    ],
    "label-skew": [
        "data.partition={name: cluster_table, table: "
        + json.dumps(_SKEW_TABLE)
        + ", clients_per_cluster: 4, samples_per_client: 125, test_fraction: 0.2}",
    ],
}


def run(
    settings: list[str], seeds: int, out: Path, data_dir: str, rounds: int | None = None
) -> list[dict]:
    """Every setting's jobs (summaries with their metric rows dropped), FedEM-lr×4 too."""
    from fedcluster.config.schema import resolve_config

    lr = resolve_config(None, PRESET, [], {}).train.lr
    jobs = []
    for name in settings:
        sets = SETTINGS[name]
        runs = [
            (sets, out / name),
            (
                [
                    *sets,
                    f"train.lr={lr * FEDEM_LR_FACTOR}",
                    "algorithms=[{name: fedem, label: fedem-lr×4, params: {n_components: 4}}]",
                ],
                out / f"{name}-fedem-lr4",
            ),
        ]
        for run_sets, path in runs:
            for job in run_setting(PRESET, run_sets, seeds, path, data_dir, rounds):
                rows = job.pop("rows")
                job["setting"] = name
                job["purity_round_1"] = rows[0]["purity"] if rows else None
                jobs.append(job)
    return jobs


def table(jobs: list[dict]) -> list[dict[str, str]]:
    """Mean ± sd over seeds of final accuracy and purity, per setting and algorithm."""
    rows = []
    for setting in [s for s in SETTINGS if any(j["setting"] == s for j in jobs)]:
        mine = [j for j in jobs if j["setting"] == setting]
        for alg in dict.fromkeys(j["algorithm"] for j in mine):
            s = [j for j in mine if j["algorithm"] == alg]
            reached = [j["rounds_to_purity_0.9"] for j in s]

            def col(key: str, scale: float = 1.0, digits: int = 2, s=s) -> str:
                return mean_std([j[key] for j in s if j[key] is not None], scale, digits)

            rows.append(
                {
                    "setting": setting,
                    "algorithm": alg,
                    "seeds": str(len(s)),
                    "final acc %": col("final_accuracy", 100, 1),
                    "purity": col("final_purity"),
                    "purity round 1": col("purity_round_1"),
                    "reached 0.9 purity": f"{sum(r is not None for r in reached)}/{len(s)}",
                    "MB up": col("bytes_up", 1e-6, 1),
                }
            )
    return rows


def main() -> None:
    p = parser(__doc__)
    p.set_defaults(seeds=3, out="runs/compare")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names")
    p.add_argument("what", nargs="?", choices=("run", "summarize"), default="run")
    args = p.parse_args()
    out = Path(args.out)
    if args.what == "summarize":
        jobs = [
            j
            for f in sorted(out.glob("compare_methods-*.json"))
            if f.name != "compare_methods-all.json"
            for j in json.loads(f.read_text())["jobs"]
        ]
        tag = "all"
    else:
        chosen = chosen_settings(p, args.settings, list(SETTINGS))
        jobs = run(chosen, args.seeds, out, args.data_dir, args.rounds)
        tag = "+".join(chosen)
    print(write_results(out, f"compare_methods-{tag}", jobs, table(jobs)))


if __name__ == "__main__":
    main()
