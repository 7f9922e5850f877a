"""The privacy-accuracy tables of the DP modes on rotation federations.

Modes (docs/privacy.md): ``local`` (client-level local DP, every upload
clipped and noised on the client), ``central`` (DP-FedAvg with adaptive
clipping at each cluster's aggregate, trusted server), ``sketch`` (central
aggregates plus a noisy 256-dimensional sketch of each client's first
update, on which DCFL and FedGroup cluster) and ``record`` (record-level
local DP: DP-SGD on every client, so every upload is already DP and the
algorithms cluster on the uploads as post-processing). Each cell is the
final pooled test accuracy and ARI, mean ± std over seeds; ε = ∞ is the run
without privacy (shared by the modes of a federation).

Rows ``ifca-private`` and ``fesem-private`` start the cluster models from the
private start (``init: private``: a DP clustering of the clients' first
updates, with ``privacy.start_share`` of the budget under central DP).

Federations (``--federation``), reductions of the docs' rotation preset
(4 groups of 0/90/180/270 degrees) with multinomial logistic regression
(``mclr``, d = 7,850), one local epoch, 15 rounds, full participation, δ = 1e-5:

- ``clients`` (default; modes local, central, sketch): 300 clients (75 per
  rotation), 60 training and 30 test images each, lr 0.1, B = 32, clip 0.4
  (the median update norm of round 1; central DP's initial C_0). Central DP
  needs many clients per cluster aggregate (the noise of a cluster mean is
  z·C/n_k), hence many small clients.
- ``records`` (mode record): 40 clients (10 per rotation) of 1,500 training
  and 250 test images, the whole of Fashion-MNIST's 70,000; lr 0.3, B = 64,
  clip 1 per sample. DP-SGD's noise per step is σ·C/(q·n) per coordinate, so
  clients with many records keep their uploads informative.
- ``mnist-2400`` and ``fmnist-2400`` (modes central, device, private, secure, sampled;
  ε = 1, 4, 8; ``secure``: the server receives only each cluster's sum; ``sampled``: 10 %
  of the clients a round): the
  population sizes DP needs, IFCA's rotated MNIST (Ghosh et al., NeurIPS 2020,
  Sec. 5.2: 2,400 clients of 100 images, 600 per rotation) and the same on
  Fashion-MNIST, mclr with IFCA's local training (10 full-batch steps at lr 0.1),
  clip 1.0 (the median update norm of round 1 on both).

    python -m benchmarks.reproduction.dp_modes --seeds 3 --out runs/dp-modes
    python -m benchmarks.reproduction.dp_modes --federation records --seeds 3
    python -m benchmarks.reproduction.dp_modes --federation mnist-2400 --seeds 3
    # round-1 signal vs noise:
    python -m benchmarks.reproduction.dp_modes --federation records --geometry

``--modes`` and ``--eps`` run a subset of the cells (e.g. more seeds of the
ε = 10 column). Seeds run outermost, and the JSON of every finished job is rewritten after
each setting, so an interrupted run still leaves a table of the seeds done.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import parser
from fedcluster.algorithms.base import init_row
from fedcluster.config.schema import resolve_config
from fedcluster.data.configured import build_federation_for
from fedcluster.experiment.runner import model_for, simulator_for
from fedcluster.experiment.summary import format_table
from fedcluster.privacy.ledger import LocalDP
from fedcluster.protocol.batches import LocalTraining
from fedcluster.reproduce import run_setting, save_json

EPSILONS = (1.0, 3.0, 10.0, 30.0)
ALGORITHMS = {
    "fedavg": "{name: fedavg}",
    "ifca": "{name: ifca, label: ifca, params: {n_clusters: 4}}",
    "dcfl": "{name: dcfl}",
    "fedgroup": "{name: fedgroup, params: {n_groups: 4}}",
    # IFCA's good initializer: initial models re-drawn until each is chosen by ≥ 20%
    "ifca-init": "{name: ifca, label: ifca-init, params: {n_clusters: 4, min_cluster_share: 0.2}}",
    # IFCA's choice (lowest loss) on the device: what secure aggregation needs
    "ifca-device": "{name: ifca, label: ifca-device, "
    "params: {n_clusters: 4, choice_on_device: true}}",
    # JGL's choice (eq. 4) made on the device from the released models and steps
    "jgl-device": "{name: jgl, label: jgl-device, params: {n_clusters: 4, choice_on_device: true}}",
    # FeSEM's E-step on the device against the released (random-initialised) centres
    "fesem-device": "{name: fesem, label: fesem-device, "
    "params: {n_clusters: 4, init: random, choice_on_device: true}}",
    # DCFL's eq. 6 and FedGroup's eq. 9 on the device against the released cluster steps
    "dcfl-device": "{name: dcfl, label: dcfl-device, "
    "params: {n_clusters: 4, choice_on_device: true}}",
    "fedgroup-device": "{name: fedgroup, label: fedgroup-device, "
    "params: {n_groups: 4, choice_on_device: true}}",
    # the private start: initial models from a DP clustering of the first updates
    "ifca-private": "{name: ifca, label: ifca-private, "
    "params: {n_clusters: 4, init: private, private_start: {clip: START_CLIP}}}",
    "fesem-private": "{name: fesem, label: fesem-private, params: {n_clusters: 4, "
    "init: private, private_start: {clip: START_CLIP}, choice_on_device: true}}",
    "ifca-device-private": "{name: ifca, label: ifca-device-private, params: {n_clusters: 4, "
    "choice_on_device: true, init: private, private_start: {clip: START_CLIP}}}",
    "dcfl-private": "{name: dcfl, label: dcfl-private, params: {n_clusters: 4, "
    "choice_on_device: true, init: private, private_start: {clip: START_CLIP}}}",
    "fedgroup-private": "{name: fedgroup, label: fedgroup-private, params: {n_groups: 4, "
    "choice_on_device: true, init: private, private_start: {clip: START_CLIP}}}",
}
# FedGroup's round-1 pre-training is one upload more than the rounds.
BUDGET = "privacy.max_participations=16"


@dataclass(frozen=True)
class Federation:
    """A federation's overrides of the rotation preset and its DP modes:
    mode -> (privacy overrides, algorithms it applies to)."""

    sets: tuple[str, ...]
    modes: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]
    out: str
    epsilons: tuple[float, ...] = EPSILONS


def rotation(n_clients: int, samples: int, test: int, train: str, clip: float) -> tuple[str, ...]:
    return (
        "data.dataset=fashion-mnist",
        "data.partition={name: rotation, n_groups: 4, base: iid, base_options: "
        f"{{n_clients: {n_clients}, samples_per_client: {samples}, test_size: {test}}}}}",
        "model.name=mclr",
        "model.options={}",
        f"train={train}",
        "checkpoint_every=1000",
        f"privacy.clip={clip}",
        "privacy.delta=1.0e-5",
    )


def ifca_rotation(dataset: str, clip: float) -> tuple[str, ...]:
    """IFCA's rotated MNIST (preset ``ifca-rotated-mnist``): 2,400 clients of 100 images in
    4 rotation groups of 600, each group a fresh permutation of all 60,000 training images,
    400 test clients; multinomial logistic regression and IFCA's local training (10
    full-batch steps at lr 0.1)."""
    return (
        f"data.dataset={dataset}",
        "data.partition={name: rotation, n_groups: 4, reuse: per_group, test_clients: 100, "
        "base: iid, base_options: {n_clients: 600, samples_per_client: 100}}",
        "model.name=mclr",
        "model.options={}",
        "train={lr: 0.1, batch_size: 100, steps: 10}",
        "checkpoint_every=1000",
        f"privacy.clip={clip}",
        "privacy.delta=1.0e-5",
    )


# The populations DP needs: central noise on a cluster mean is z·C/n_k.
POPULATION_EPSILONS = (1.0, 4.0, 8.0)
POPULATION_MODES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "central": (("privacy.mode=central",), ("fedavg", "ifca")),
    "device": (
        ("privacy.mode=central",),
        ("jgl-device", "fesem-device", "dcfl-device", "fedgroup-device"),
    ),
    "private": (
        ("privacy.mode=central",),
        ("ifca-private", "dcfl-private", "fedgroup-private"),
    ),
    "secure": (
        ("privacy.mode=central", "privacy.secure_aggregation=true"),
        ("fedavg", "ifca-device", "ifca-device-private", "dcfl-private", "fedgroup-private"),
    ),
    # partial participation: 10 % of the clients a round, the accountant's sampling rate q;
    # the start (sample rate 1) gets 5 % of the precision, the amplified aggregates the rest
    "sampled": (
        ("privacy.mode=central", "participation.fraction=0.1", "privacy.start_share=0.05"),
        ("fedavg", "ifca-private", "fedgroup-private"),
    ),
}

FEDERATIONS = {
    "clients": Federation(
        rotation(300, 60, 30, "{lr: 0.1, batch_size: 32, epochs: 1}", 0.4),
        {
            "local": (("privacy.mode=client",), ("fedavg", "ifca", "dcfl", "fedgroup")),
            "central": (
                ("privacy.mode=central",),
                ("fedavg", "ifca", "ifca-init", "ifca-private"),
            ),
            "device": (
                ("privacy.mode=central",),
                ("jgl-device", "fesem-device", "fesem-private", "dcfl-device", "fedgroup-device"),
            ),
            "sketch": (
                ("privacy.mode=central", "privacy.sketch_dim=256", BUDGET),
                ("dcfl", "fedgroup"),
            ),
        },
        "runs/dp-modes",
    ),
    "mnist-2400": Federation(
        ifca_rotation("mnist", 1.0),
        POPULATION_MODES,
        "runs/dp-mnist-2400",
        POPULATION_EPSILONS,
    ),
    "fmnist-2400": Federation(
        ifca_rotation("fashion-mnist", 1.0),
        POPULATION_MODES,
        "runs/dp-fmnist-2400",
        POPULATION_EPSILONS,
    ),
    "records": Federation(
        rotation(40, 1500, 250, "{lr: 0.3, batch_size: 64, epochs: 1}", 1.0),
        {"record": (("privacy.mode=record", BUDGET), ("fedavg", "ifca", "dcfl", "fedgroup"))},
        "runs/dp-modes-records",
    ),
}


def clip_of(fed: Federation) -> float:
    """The federation's privacy.clip, also the private start's clip without privacy."""
    return next(float(s.split("=")[1]) for s in fed.sets if s.startswith("privacy.clip="))


def settings(fed: Federation) -> list[tuple[str, float, tuple[str, ...], list[str]]]:
    """``(mode, ε, algorithms, overrides)``: one run (one federation) per mode and ε,
    and the run without privacy of every algorithm a mode applies to."""
    every = tuple(a for a in ALGORITHMS if any(a in algs for _, algs in fed.modes.values()))
    out = [("none", math.inf, every, [])]
    for eps in fed.epsilons:
        for mode, (sets, algorithms) in fed.modes.items():
            out.append((mode, eps, algorithms, [*sets, f"privacy.epsilon={eps}"]))
    return out


def cell(jobs: list[dict]) -> str:
    acc = [100 * j["accuracy"] for j in jobs]
    ari = [j["ari"] for j in jobs if j["ari"] is not None]
    text = f"{np.mean(acc):.1f} ± {np.std(acc):.1f}"
    if ari:
        text += f" (ARI {np.mean(ari):.2f})"
    return text


def table(fed: Federation, results: list[dict]) -> str:
    """Rows (mode, algorithm), columns ε; the no-privacy column repeats in every mode;
    the last column counts the seeds of each ε's cell."""
    rows = []
    for mode, (_, algorithms) in fed.modes.items():
        for a in algorithms:
            row = {"mode": mode, "algorithm": a}
            seeds = []
            for eps in (*fed.epsilons, math.inf):
                m = "none" if math.isinf(eps) else mode
                jobs = [
                    r for r in results if r["mode"] == m and r["algorithm"] == a and r["eps"] == eps
                ]
                seeds.append(str(len(jobs)))
                row["ε = ∞" if math.isinf(eps) else f"ε = {eps:g}"] = cell(jobs) if jobs else "-"
            row["seeds per ε"] = "/".join(seeds)
            rows.append(row)
    return format_table(rows)


def geometry(fed: Federation, data_dir: str, epsilon: float, seed: int = 0) -> dict:
    """Round 1 of record-level DP from the initial model, measured: every client's
    update without noise (clipped DP-SGD, σ = 0) and with the σ that ``epsilon``
    calibrates, on the same batches; the group centroids of the noiseless updates,
    their distances, and where the noisy updates fall (nearest true centroid)."""
    sets = [*fed.sets, "privacy.mode=record", BUDGET, f"privacy.epsilon={epsilon}"]
    config = resolve_config(None, "rotation", sets, {"data": {"data_dir": data_dir}})
    federation = build_federation_for(config, seed)
    model = model_for(config, federation)
    sim = simulator_for(config, model, federation, seed)
    ledger = LocalDP.from_config(config, federation.train_sizes, seed)
    train = ledger.local_training(LocalTraining(**config.train.model_dump(exclude={"loss"})))
    clients = np.arange(federation.n_clients)
    start = init_row(model, seed, "init")
    noisy = sim.train(clients, start, train, rnd=1).rows - start
    clean_train = replace(train, dp=replace(train.dp, noise_multiplier=0.0))
    clean = sim.train(clients, start, clean_train, rnd=1).rows - start
    groups = np.asarray(federation.groups)
    centroids = torch.stack([clean[groups == g].mean(dim=0) for g in np.unique(groups)])
    between = torch.cdist(centroids, centroids)
    off = between[~torch.eye(len(centroids), dtype=torch.bool)]
    nearest = torch.cdist(noisy, centroids).argmin(dim=1).numpy()
    return {
        "sigma": float(ledger.noise_multiplier[0]),
        "sample_rate": float(ledger.sample_rate[0]),
        "steps_per_upload": int(ledger.release_cost[0]),
        "clean_norm_median": clean.norm(dim=1).median().item(),
        "noise_norm_median": (noisy - clean).norm(dim=1).median().item(),
        "spread_to_centroid_mean": (clean - centroids[groups]).norm(dim=1).mean().item(),
        "centroid_distance_min": off.min().item(),
        "centroid_distance_max": off.max().item(),
        "centroid_cosine_max": max(
            torch.nn.functional.cosine_similarity(centroids[i], centroids[j], dim=0).item()
            for i in range(len(centroids))
            for j in range(i + 1, len(centroids))
        ),
        "noisy_misplaced": float(np.mean(nearest != groups)),
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.set_defaults(seeds=3, rounds=15, out=None)
    p.add_argument("--federation", choices=sorted(FEDERATIONS), default="clients")
    p.add_argument("--modes", default=None, help="comma-separated subset (default: all, none)")
    p.add_argument(
        "--eps", default=None, help="comma-separated subset (inf: none; default: the federation's)"
    )
    p.add_argument(
        "--geometry",
        action="store_true",
        help="print round 1's update geometry under record-level DP at each --eps, and stop",
    )
    args = p.parse_args()
    fed = FEDERATIONS[args.federation]
    epsilons = {float(e) for e in args.eps.split(",")} if args.eps else {*fed.epsilons, math.inf}
    if args.geometry:
        for eps in sorted(e for e in epsilons if not math.isinf(e)):
            print(f"ε = {eps:g}:", json.dumps(geometry(fed, args.data_dir, eps)), flush=True)
        return
    modes = set((args.modes or ",".join(["none", *fed.modes])).split(","))
    out = Path(args.out or fed.out)
    path = out / "dp_modes.json"
    results: list[dict] = json.loads(path.read_text()) if path.exists() else []
    done = {(r["mode"], r["eps"], r["seed"], r["algorithm"]) for r in results}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for mode, eps, algorithms, sets in settings(fed):
            missing = [a for a in algorithms if (mode, eps, seed, a) not in done]
            if not missing or mode not in modes or eps not in epsilons:
                continue
            label = f"{mode}-eps{eps:g}"
            run_dir = out / label / f"seed{seed}"
            if len(missing) < len(algorithms) or run_dir.exists():  # added or interrupted
                run_dir = run_dir.with_name(f"seed{seed}-{'-'.join(missing)}")
            specs = ", ".join(
                ALGORITHMS[a].replace("START_CLIP", str(clip_of(fed))) for a in missing
            )
            summaries = run_setting(
                "rotation",
                [*fed.sets, f"algorithms=[{specs}]", *sets],
                1,
                run_dir,
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
        print(table(fed, results), flush=True)


if __name__ == "__main__":
    main()
