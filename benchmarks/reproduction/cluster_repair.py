"""Cluster repair and the JGL similarity ablation: purity, rounds to 0.9, accuracy, bytes.

Repair (``repair``): IFCA, JGL and FeSEM with and without ``repair: {}``
(:mod:`fedcluster.algorithms.repair`) on

- ``main``: the main job (``tests/golden/configs/main-job.yaml``: 24 clients of
  mnist5k in 4 rotation groups, 30 rounds), where both merge 0° and 180°;
- ``jgl-mnist`` / ``jgl-fmnist``: JGL's Fig. 2 tables (MNIST, Fashion-MNIST),
  scaled to 0.27 (about 200 samples per client), global labels, random init;
- ``ifca-rot``: IFCA's rotated MNIST (the ``ifca-rotated-mnist`` preset at a tenth
  of its size: 240 clients of 100 images, 40 test clients, 20 rounds).

Ablation (``ablation``): JGL with λ ∈ {0.2, 0.5, 0.8} × loss reduction {sum,
mean} × similarity {cosine, euclidean}, and IFCA, on ``jgl-mnist`` /
``jgl-fmnist``; reports the JGL choices that differ from the loss-only choice
(diagnostic ``differs_from_loss_choice``, summed over rounds and clients).

    python -m benchmarks.reproduction.cluster_repair repair --settings main --seeds 5 \\
        --out runs/repair
    python -m benchmarks.reproduction.cluster_repair ablation --settings jgl-mnist --seeds 2 \\
        --rounds 10 \\
        --out runs/ablation

``--rounds`` overrides each setting's rounds, ``--scale`` the JGL tables' size
(default 0.27: about 200 samples per client), ``--reductions sum`` runs half
the ablation grid (e.g. one process per reduction).
"""

from __future__ import annotations

import csv
from pathlib import Path

from benchmarks.common import REPO, parser
from fedcluster.experiment.summary import format_table
from fedcluster.reproduce import mean_std, run_setting, save_json

MAIN_JOB = str(REPO / "tests" / "golden" / "configs" / "main-job.yaml")
JGL_TABLE = ["data.partition.relabel=false"]
SETTINGS: dict[str, tuple[str | None, str | None, list[str], int]] = {
    # tag: (config file, preset, --set assignments, rounds)
    "main": (MAIN_JOB, None, [], 30),
    "jgl-mnist": (None, "jgl-mnist", JGL_TABLE, 15),
    "jgl-fmnist": (
        None,
        "jgl-mnist",
        [*JGL_TABLE, "data.dataset=fashion-mnist", "data.partition.table=jgl-fashion-mnist"],
        15,
    ),
    # IFCA's rotated MNIST (the ifca-rotated-mnist preset) at a tenth of its size: 4 x 60
    # clients of 100 images, 4 x 10 test clients, own-loss test protocol
    "ifca-rot": (
        None,
        "ifca-rotated-mnist",
        [
            "data.partition.base_options={n_clients: 60, samples_per_client: 100}",
            "data.partition.test_clients=10",
            "eval_every=5",
        ],
        20,
    ),
}


def repair_algorithms(tag: str) -> str:
    """IFCA (as the setting's paper runs it), JGL λ = 0.2 and FeSEM, each without and with
    ``repair: {}``; IFCA's own rotated MNIST runs IFCA only."""
    ifca = "choice_batches: all, weighting: uniform" if tag == "ifca-rot" else "weighting: uniform"
    bases = {"ifca": f"ifca, params: {{n_clusters: 4, {ifca}"}
    if tag != "ifca-rot":
        bases["jgl"] = "jgl, params: {n_clusters: 4, lam: 0.2"
        bases["fesem"] = "fesem, params: {n_clusters: 4"
    algs = []
    for label, spec in bases.items():
        algs.append(f"{{name: {spec}}}, label: {label}}}")
        algs.append(f"{{name: {spec}, repair: {{}}}}, label: {label}+repair}}")
    return "[" + ", ".join(algs) + "]"


def ablation_algorithms(reductions: list[str], lams: list[str], ifca: bool = True) -> str:
    ifca_spec = "{name: ifca, label: ifca, params: {n_clusters: 4, weighting: uniform}}"
    algs = [ifca_spec] if ifca else []
    for lam in lams:
        for reduction in reductions:
            for sim in ("cosine", "euclidean"):
                algs.append(
                    f"{{name: jgl, label: jgl-{lam}-{reduction}-{sim}, params: {{n_clusters: 4,"
                    f" lam: {lam}, loss_reduction: {reduction}, similarity: {sim}}}}}"
                )
    return "[" + ", ".join(algs) + "]"


def differs(run_dir: Path) -> dict[str, float]:
    """Sum of ``differs_from_loss_choice`` over rounds and seeds, per algorithm label."""
    out: dict[str, float] = {}
    path = run_dir / "diagnostics.csv"
    if not path.exists():
        return out
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["name"] == "differs_from_loss_choice":
                out[r["algorithm"]] = out.get(r["algorithm"], 0.0) + float(r["value"])
    return out


def main() -> None:
    p = parser(__doc__)
    p.add_argument("kind", choices=("repair", "ablation"))
    p.add_argument("--settings", default="main", help="comma-separated: " + ",".join(SETTINGS))
    p.add_argument("--scale", type=float, default=0.27, help="JGL tables: Fig. 2 counts x scale")
    p.add_argument("--reductions", default="sum,mean", help="ablation: loss reductions to run")
    p.add_argument("--lams", default="0.2,0.5,0.8", help="ablation: values of λ to run")
    p.add_argument("--skip-ifca", action="store_true", help="ablation: leave IFCA out")
    args = p.parse_args()
    out = Path(args.out)
    table = []
    for tag in args.settings.split(","):
        if tag not in SETTINGS:
            p.error(f"unknown setting {tag!r}; choose from {list(SETTINGS)}")
        config, preset, sets, rounds = SETTINGS[tag]
        if args.kind == "repair":
            algs = repair_algorithms(tag)
        else:
            algs = ablation_algorithms(
                args.reductions.split(","), args.lams.split(","), not args.skip_ifca
            )
        if tag.startswith("jgl"):
            sets = [*sets, f"data.partition.scale={args.scale}"]
        grid = f"{args.reductions}-{args.lams}".replace(",", "+")
        run_dir = out / f"{args.kind}-{tag}-{grid}-s{args.first_seed}"
        jobs = run_setting(
            preset,
            [*sets, "algorithms=" + algs],
            args.seeds,
            run_dir,
            args.data_dir,
            args.rounds or rounds,
            args.first_seed,
            config_path=config,
        )
        choices = differs(run_dir)
        for alg in dict.fromkeys(j["algorithm"] for j in jobs):
            mine = [j for j in jobs if j["algorithm"] == alg]
            reached = [j["rounds_to_purity_0.9"] for j in mine]
            row = {
                "setting": tag,
                "algorithm": alg,
                "seeds": str(len(mine)),
                "final purity": mean_std([j["final_purity"] for j in mine], 1, 2),
                "reached 0.9": f"{sum(r is not None for r in reached)}/{len(mine)}",
                "rounds to 0.9": mean_std([float(r) for r in reached if r is not None]),
                "final acc %": mean_std([j["final_accuracy"] for j in mine], 100),
                "MB up": mean_std([j["bytes_up"] / 1e6 for j in mine], 1, 1),
                "MB down": mean_std([j["bytes_down"] / 1e6 for j in mine], 1, 1),
            }
            if args.kind == "ablation":
                n_choices = sum(int(j["rounds"]) for j in mine)  # rounds × seeds (× clients)
                row["differs (per round, all clients)"] = (
                    f"{choices.get(alg, 0.0) / max(n_choices, 1):.2f}"
                )
            table.append(row)
    name = f"{args.kind}-{args.settings}-{args.reductions}-{args.lams}".replace(",", "+")
    save_json(out / f"{name}-s{args.first_seed}.json", table)
    print(format_table(table))


if __name__ == "__main__":
    main()
