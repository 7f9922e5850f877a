"""The privacy-accuracy table of the three DP modes on the Fashion-MNIST rotation federation.

Modes (docs/privacy.md): ``local`` (client-level local DP, every upload
clipped and noised on the client), ``central`` (DP-FedAvg with adaptive
clipping at each cluster's aggregate, trusted server) and ``sketch``
(central aggregates plus a noisy 256-dimensional sketch of each client's
first update, on which DCFL and FedGroup cluster). Each cell is the final
pooled test accuracy and ARI, mean ± std over seeds; ε = ∞ is the run
without privacy (shared by the three modes).

The federation is a reduction of the docs' rotation preset to fit the
shared machine: 300 clients (75 per rotation of 0/90/180/270 degrees), 60
training and 30 test images each, multinomial logistic regression
(``mclr``, d = 7,850), lr 0.1, B = 32, one local epoch, 15 rounds, full
participation; δ = 1e-5, initial clip 0.4 (the median update norm of round 1).
Central DP needs many clients per cluster aggregate (the noise of a cluster
mean is z·C/n_k), hence many small clients and a small model.

    python -m benchmarks.dp_modes --seeds 3 --out runs/dp-modes
    python -m benchmarks.dp_modes --seeds 2 --first-seed 1 --modes none,central,sketch --eps 10,inf

``--modes`` and ``--eps`` run a subset of the cells (e.g. more seeds of the
ε = 10 column). Seeds run outermost, and the JSON of every finished job is rewritten after
each setting, so an interrupted run still leaves a table of the seeds done.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from benchmarks.common import parser, run_setting, save_json
from fedcluster.report import format_table

EPSILONS = (1.0, 3.0, 10.0, 30.0)
FEDERATION = [
    "data.dataset=fashion-mnist",
    "data.partition={name: rotation, n_groups: 4, base: iid, "
    "base_options: {n_clients: 300, samples_per_client: 60, test_size: 30}}",
    "model.name=mclr",
    "model.options={}",
    "train={lr: 0.1, batch_size: 32, epochs: 1}",
    "checkpoint_every=1000",
    "privacy.clip=0.4",
    "privacy.delta=1.0e-5",
]
ALGORITHMS = {
    "fedavg": "{name: fedavg}",
    "ifca": "{name: ifca, params: {n_clusters: 4}}",
    "dcfl": "{name: dcfl}",
    "fedgroup": "{name: fedgroup, params: {n_groups: 4}}",
}
MODES = {  # mode -> (privacy overrides, algorithms it applies to)
    "local": (["privacy.mode=client"], ("fedavg", "ifca", "dcfl", "fedgroup")),
    "central": (["privacy.mode=central"], ("fedavg", "ifca")),
    "sketch": (["privacy.mode=central", "privacy.sketch_dim=256"], ("dcfl", "fedgroup")),
}


def settings() -> list[tuple[str, float, tuple[str, ...], list[str]]]:
    """``(mode, ε, algorithms, overrides)``: one run (one federation) per mode and ε.
    Under sketches the budget allows FedGroup's round-1 pre-training upload (one
    more than the rounds); under local DP a client over budget sits its last round out."""
    out = [("none", math.inf, tuple(ALGORITHMS), [])]
    for eps in EPSILONS:
        for mode, (sets, algorithms) in MODES.items():
            budget = ["privacy.max_participations=16"] if mode == "sketch" else []
            out.append((mode, eps, algorithms, [*sets, f"privacy.epsilon={eps}", *budget]))
    return out


def cell(jobs: list[dict]) -> str:
    acc = [100 * j["accuracy"] for j in jobs]
    ari = [j["ari"] for j in jobs if j["ari"] is not None]
    text = f"{np.mean(acc):.1f} ± {np.std(acc):.1f}"
    if ari:
        text += f" (ARI {np.mean(ari):.2f})"
    return text


def table(results: list[dict]) -> str:
    """Rows (mode, algorithm), columns ε; the no-privacy column repeats in every mode;
    the last column counts the seeds of each ε's cell."""
    rows = []
    for mode, (_, algorithms) in MODES.items():
        for a in algorithms:
            row = {"mode": mode, "algorithm": a}
            seeds = []
            for eps in (*EPSILONS, math.inf):
                m = "none" if math.isinf(eps) else mode
                jobs = [
                    r for r in results if r["mode"] == m and r["algorithm"] == a and r["eps"] == eps
                ]
                seeds.append(str(len(jobs)))
                row["ε = ∞" if math.isinf(eps) else f"ε = {eps:g}"] = cell(jobs) if jobs else "-"
            row["seeds per ε"] = "/".join(seeds)
            rows.append(row)
    return format_table(rows)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.set_defaults(seeds=3, rounds=15, out="runs/dp-modes")
    p.add_argument("--modes", default="none,local,central,sketch", help="comma-separated subset")
    p.add_argument("--eps", default="1,3,10,30,inf", help="comma-separated subset (inf: none)")
    args = p.parse_args()
    modes = set(args.modes.split(","))
    epsilons = {float(e) for e in args.eps.split(",")}
    out = Path(args.out)
    path = out / "dp_modes.json"
    results: list[dict] = json.loads(path.read_text()) if path.exists() else []
    done = {(r["mode"], r["eps"], r["seed"]) for r in results}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for mode, eps, algorithms, sets in settings():
            if (mode, eps, seed) in done or mode not in modes or eps not in epsilons:
                continue
            label = f"{mode}-eps{eps:g}"
            specs = ", ".join(ALGORITHMS[a] for a in algorithms)
            summaries = run_setting(
                "rotation",
                [*FEDERATION, f"algorithms=[{specs}]", *sets],
                1,
                out / label / f"seed{seed}",
                args.data_dir,
                args.rounds,
                first_seed=seed,
            )
            for summary in summaries:
                last = summary["rows"][-1]
                results.append(
                    {
                        "mode": mode,
                        "eps": eps,
                        "algorithm": summary["algorithm"],
                        "seed": seed,
                        "accuracy": float(last["accuracy"]),
                        "ari": summary["final_ari"],
                        "epsilon_spent": float(last["epsilon"]),
                        "seconds": sum(
                            r["client_seconds"] + r["server_seconds"] for r in summary["rows"]
                        ),
                    }
                )
            save_json(path, results)
            print(label, "seed", seed, "done", flush=True)
        print(table(results), flush=True)


if __name__ == "__main__":
    main()
