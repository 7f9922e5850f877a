"""Attacks within the norm bound against plain and robust rules (docs/reliability.md).

The quickstart federation (5,000 MNIST digits, 24 clients in 4 rotation
groups, MLP 200-100), 6 of the 24 clients attacking (12 in the mixed
setting), for FedAvg, IFCA, JGL, DCFL and FedGroup under each aggregation
rule; the honest clients' final accuracy (``honest_accuracy``, mean over
seeds) beside the fault-free run over the same clients
(:func:`benchmarks.robustness.reliability.baseline`). The attacks
(:mod:`fedcluster.experiment.scenario`):

- ``x10-25``: updates boosted ×10 (``scaled``);
- ``flip-25``: sign-flipped updates (``sign_flip``);
- ``labels-25``: training on labels y → 9 − y (``label_flip``, a data attack);
- ``alie-25``: "a little is enough" (Baruch et al., NeurIPS 2019): every
  attacker sends the honest updates' mean minus z standard deviations, z from
  the paper's formula (0.55 for 6 of 24);
- ``mixed-50``: 25% ×10 and 25% sign flips together.

    python -m benchmarks.robustness.attacks --seeds 3 --rounds 15 --out runs/attacks

``--settings`` / ``--rules`` / ``--algorithms`` run subsets (comma-separated);
``--report`` prints the table of a finished ``results.json``; ``--clusters``
prints, per run directory and clustered algorithm, (honest clients sharing
their final cluster with an attacker, honest clients, clusters held by
attackers alone): where the attackers sit in the clustering, a cause of a
missed goal that no aggregation rule can undo.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from benchmarks.common import parser
from benchmarks.robustness.reliability import ALGORITHMS as RELIABILITY_ALGORITHMS
from benchmarks.robustness.reliability import RULES, run_table

SETTINGS: dict[str, dict] = {
    "x10-25": {"share": 0.25, "kinds": ["scaled"], "scaled_factor": 10.0},
    "flip-25": {"share": 0.25, "kinds": ["sign_flip"], "flip_factor": 1.0},
    "labels-25": {"share": 0.25, "kinds": ["label_flip"]},
    "alie-25": {"share": 0.25, "kinds": ["alie"]},
    "mixed-50": {"share": 0.5, "kinds": ["scaled", "sign_flip"], "scaled_factor": 10.0},
}

ALGORITHMS = {a: RELIABILITY_ALGORITHMS[a] for a in ("fedavg", "ifca", "jgl", "dcfl", "fedgroup")}


def hostages(run: Path) -> dict[str, tuple[int, int, int]]:
    """Per clustered algorithm of ``run``, at the final round: honest clients whose cluster
    holds an attacker, honest clients, and clusters of attackers only (a cluster model
    the honest clients lost), from clusters.csv and events.csv."""
    with open(run / "events.csv", newline="") as f:
        events = list(csv.DictReader(f))
    attackers = {(r["algorithm"], r["client"]) for r in events if r["kind"] == "faulty"}
    with open(run / "clusters.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    found = {}
    for alg in sorted({r["algorithm"] for r in rows}):
        last = max(int(r["round"]) for r in rows if r["algorithm"] == alg)
        final = [r for r in rows if r["algorithm"] == alg and int(r["round"]) == last]
        bad = {r["cluster"] for r in final if (alg, r["client"]) in attackers}
        honest = [r for r in final if (alg, r["client"]) not in attackers]
        shared = {r["cluster"] for r in honest}
        found[alg] = (sum(r["cluster"] in bad for r in honest), len(honest), len(bad - shared))
    return found


def main() -> None:
    if "--clusters" in sys.argv:
        out = Path(sys.argv[sys.argv.index("--clusters") + 1])
        for run in sorted(out.glob("seed*/*/*")):
            print(run.relative_to(out), hostages(run))
        return
    p = parser(__doc__)
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--rules", default="mean,aligned_mean,guarded_mean")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.set_defaults(seeds=3, rounds=15, out="runs/attacks")
    run_table(p, SETTINGS, RULES, ALGORITHMS)


if __name__ == "__main__":
    main()
