"""JGL vs IFCA on the JGL MNIST setting: rounds to 0.9 purity and accuracy (JGL Fig. 4).

Sweeps λ ∈ {0.1, 0.2, 0.5} for JGL and IFCA (λ = 0), with global labels and with
each cluster's 8 classes relabelled 0-7, and with independent random initial
models and with IFCA's good initializer, over several seeds. The Fig. 2 table
is scaled (default 0.27, about 200 samples per client, the DESIGN speed
setting) to keep the sweep within minutes on 2 cores.

    python -m benchmarks.reproduction.jgl_purity --seeds 5 --rounds 30 --out runs/jgl-purity

``--settings global-random,relabel-good`` runs a subset of the four settings
(tags ``{global,relabel}-{random,good}``), e.g. one per process.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.common import parser
from fedcluster.experiment.summary import format_table
from fedcluster.reproduce import chosen_settings, mean_std, run_setting, save_json

ALGORITHMS = (
    "[{name: jgl, label: jgl-0.1, params: {n_clusters: 4, lam: 0.1, INIT}},"
    " {name: jgl, label: jgl-0.2, params: {n_clusters: 4, lam: 0.2, INIT}},"
    " {name: jgl, label: jgl-0.5, params: {n_clusters: 4, lam: 0.5, INIT}},"
    " {name: ifca, label: ifca, params: {n_clusters: 4, weighting: uniform, INIT}}]"
)

SETTINGS = ("global-random", "global-good", "relabel-random", "relabel-good")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--scale", type=float, default=0.27)
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated tags")
    args = p.parse_args()
    chosen = chosen_settings(p, args.settings, list(SETTINGS))
    out = Path(args.out)
    table = []
    for relabel in (False, True):
        for init_name, init in (
            ("random", "init: random"),
            ("good initializer", "min_cluster_share: 0.15"),
        ):
            sets = [
                f"data.partition.scale={args.scale}",
                f"data.partition.relabel={str(relabel).lower()}",
                "algorithms=" + ALGORITHMS.replace("INIT", init),
            ]
            tag = f"{'relabel' if relabel else 'global'}-{init_name.split()[0]}"
            if tag not in chosen:
                continue
            jobs = run_setting("jgl-mnist", sets, args.seeds, out / tag, args.data_dir, args.rounds)
            for alg in ("jgl-0.1", "jgl-0.2", "jgl-0.5", "ifca"):
                mine = [j for j in jobs if j["algorithm"] == alg]
                reached = [j["rounds_to_purity_0.9"] for j in mine]
                table.append(
                    {
                        "labels": "per-cluster 0-7" if relabel else "global",
                        "init": init_name,
                        "algorithm": alg,
                        "rounds to 0.9 purity": mean_std(
                            [float(r) for r in reached if r is not None]
                        ),
                        "reached 0.9": f"{sum(r is not None for r in reached)}/{len(mine)}",
                        "final purity": mean_std([j["final_purity"] for j in mine], 1, 2),
                        "final acc %": mean_std([j["final_accuracy"] for j in mine], 100),
                        "best acc %": mean_std([j["best_accuracy"] for j in mine], 100),
                        "mean purity, rounds 1-5": mean_std(
                            [float(np.mean([r["purity"] for r in j["rows"][:5]])) for j in mine],
                            1,
                            2,
                        ),
                    }
                )
    save_json(out / f"jgl_purity-{'+'.join(chosen)}.json", table)
    print(format_table(table))


if __name__ == "__main__":
    main()
