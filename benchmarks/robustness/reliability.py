"""Faulty clients against plain and robust aggregation (docs/reliability.md).

The main job's federation (the quickstart preset: 5,000 MNIST digits, 24
clients in 4 rotation groups, MLP 200-100), with a share of faulty clients
whose uploads are corrupted (:class:`fedcluster.experiment.scenario.FaultyUploads`), for
FedAvg, IFCA, JGL, CFLGT, DCFL and FedGroup, under the plain weighted average
(``aggregation.rule: mean``, the papers' rule) and the robust rules
(:mod:`fedcluster.algorithms.robust`). Reports the final test accuracy of the
sound clients (``honest_accuracy`` in diagnostics.csv; mean over seeds) per
algorithm, setting and rule, beside the fault-free run over the same clients.

    python -m benchmarks.robustness.reliability --seeds 3 --rounds 10 --out runs/reliability

``--settings`` / ``--rules`` / ``--algorithms`` run subsets (comma-separated).
Accuracy is deterministic (same config + seed = same numbers), so the
machine's load does not change the table, only how long it takes.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from typing import get_args

import numpy as np

from benchmarks.common import parser
from fedcluster.config.schema import AggregationConfig, AggregationRule
from fedcluster.experiment.summary import format_table
from fedcluster.reproduce import run_setting, save_json

# name -> scenario.faulty section (share of the 24 clients and their faults)
SETTINGS: dict[str, dict] = {  # in the order they run: the goals' settings first
    "scaled-25": {"share": 0.25, "kinds": ["scaled"], "scaled_factor": 10.0},
    "flip-25": {"share": 0.25, "kinds": ["sign_flip"], "flip_factor": 1.0},
    "huge-60": {"share": 0.6, "kinds": ["huge"], "scale": 1e6},
    "flip5-40": {"share": 0.4, "kinds": ["sign_flip"], "flip_factor": 5.0},
    "nan-inf-25": {"share": 0.25, "kinds": ["nan", "inf"]},
    "huge-25": {"share": 0.25, "kinds": ["huge"], "scale": 1e6},
}


def baseline(share: float) -> str:
    """The fault-free run that marks the same clients faulty as a setting with ``share``.

    Its "faulty" clients send their honest update ×1, so the run is the plain
    one (to float rounding) and its ``honest_accuracy`` covers exactly the
    clients the setting leaves sound (:func:`fedcluster.experiment.scenario.faulty_clients`
    draws them from one permutation per seed).
    """
    return f"none-{round(100 * share)}"


def fault_free(share: float) -> dict:
    """The scenario.faulty section of :func:`baseline`'s run: the same clients, honest ×1."""
    return {"share": share, "kinds": ["scaled"], "scaled_factor": 1.0}


ALGORITHMS: dict[str, str] = {
    "fedavg": "{name: fedavg}",
    "ifca": "{name: ifca, params: {n_clusters: 4}}",
    "jgl": "{name: jgl, params: {n_clusters: 4, lam: 0.2}}",
    "cflgt": "{name: cflgt, params: {pretrain_rounds: 5}}",
    "dcfl": "{name: dcfl}",
    "fedgroup": "{name: fedgroup, params: {n_groups: 4}}",
}

RULES = get_args(AggregationRule)


def honest_accuracies(run: Path) -> dict[str, float]:
    """Per algorithm label, the last ``honest_accuracy`` in ``run``/diagnostics.csv."""
    found: dict[str, float] = {}
    with open(run / "diagnostics.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row["name"] == "honest_accuracy":
                found[row["algorithm"]] = float(row["value"])
    return found


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--rules", default="mean,clipped_mean,aligned_mean")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.set_defaults(seeds=3, rounds=10, out="runs/reliability", clip_quantile=0.25)
    run_table(p, SETTINGS, RULES, ALGORITHMS)


def run_table(
    p: argparse.ArgumentParser,
    known_settings: dict[str, dict],
    known_rules: tuple[str, ...],
    known_algorithms: dict[str, str],
) -> None:
    """Parse ``p``'s arguments, run every (seed, setting, rule) not yet in results.json (all
    the chosen algorithms in one run) and print :func:`table`."""
    p.add_argument("--trim", type=float, default=0.25, help="trimmed_mean: share cut per side")
    p.add_argument(
        "--clip-quantile",
        type=float,
        default=AggregationConfig().clip_quantile,
        help="clipped_mean, aligned_mean, guarded_mean: norm quantile clipped to",
    )
    p.add_argument(
        "--byzantine", type=float, default=0.25, help="multi_krum: share of updates left out"
    )
    p.add_argument("--report", action="store_true", help="print the table of results.json only")
    args = p.parse_args()
    settings, rules, algs = (s.split(",") for s in (args.settings, args.rules, args.algorithms))
    for given, known in (
        (settings, known_settings),
        (rules, known_rules),
        (algs, known_algorithms),
    ):
        unknown = sorted(set(given) - set(known))
        if unknown:
            p.error(f"unknown {unknown}; choose from {list(known)}")
    out = Path(args.out)
    results_path = out / "results.json"
    # results[setting/rule][algorithm][seed] = final accuracy of the sound clients; seeds
    # outermost, so a benchmark stopped early holds whole tables for its first seeds
    # (and resumes from them)
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    algorithms = "algorithms=[" + ", ".join(known_algorithms[a] for a in algs) + "]"
    shares = sorted({known_settings[s]["share"] for s in settings})
    runs = [(baseline(share), "mean", fault_free(share)) for share in shares]
    runs += [(s, rule, known_settings[s]) for s in settings for rule in rules]
    for seed in [] if args.report else range(args.first_seed, args.first_seed + args.seeds):
        for setting, rule, faulty in runs:
            key = f"{setting}/{rule}"
            done = results.setdefault(key, {})
            if all(str(seed) in done.get(a, {}) for a in algs):
                continue
            sets = [
                algorithms,
                f"scenario.faulty={json.dumps(faulty)}",
                f"aggregation={{rule: {rule}, trim: {args.trim}, "
                f"clip_quantile: {args.clip_quantile}, byzantine: {args.byzantine}}}",
                "checkpoint_every=1000",
                "eval_every=1000",  # the final round only: the table reports nothing else
            ]
            where = out / f"seed{seed}" / setting / rule
            run_setting("quickstart", sets, 1, where, args.data_dir, args.rounds, first_seed=seed)
            honest = honest_accuracies(where)
            for alg, acc in honest.items():
                done.setdefault(alg, {})[str(seed)] = acc
            save_json(results_path, results)
            print(f"seed {seed} {key}", honest, flush=True)
    print(format_table(table(results, {s: known_settings[s] for s in settings}, rules, algs)))


def table(
    results: dict, settings: dict[str, dict], rules: list[str], algs: list[str]
) -> list[dict]:
    """Rows (algorithm, setting): the sound clients' accuracy in % (mean over seeds) per rule.

    ``fault-free`` is the plain average with the setting's faulty clients sending
    honest updates (:func:`baseline`), over the same sound clients: the goals' yardstick.
    """

    def mean(key: str, alg: str, seeds: set[str]) -> tuple[str, int]:
        accs = [v for k, v in results.get(key, {}).get(alg, {}).items() if k in seeds]
        return (f"{100 * np.mean(accs):.1f}" if accs else "-"), len(accs)

    rows = []
    for alg in algs:
        for setting in settings:
            base = f"{baseline(settings[setting]['share'])}/mean"
            # only seeds with a fault-free baseline: every cell of a row averages the same seeds
            seeds = set(results.get(base, {}).get(alg, {}))
            clean, _ = mean(base, alg, seeds)
            row: dict[str, str] = {"algorithm": alg, "setting": setting, "fault-free": clean}
            counts = []
            for rule in rules:
                row[rule], n = mean(f"{setting}/{rule}", alg, seeds)
                counts.append(n)
            row["seeds"] = str(min(counts))
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
