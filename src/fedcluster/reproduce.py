"""Reproduction runs of the CFLGT, FedGroup and DCFL papers' main experiments.

Each experiment runs a preset over several seeds (every algorithm on the same
federation, initial model and seeds) and prints a table of mean ± std over
seeds; ``--out`` keeps the run directories and a JSON of the table.

    python -m fedcluster.reproduce cflgt-s1 --seeds 3 --out runs/repro
    python -m fedcluster.reproduce fedgroup-mnist --seeds 3 --out runs/repro
    python -m fedcluster.reproduce fedgroup-synthetic --seeds 3 --out runs/repro
    python -m fedcluster.reproduce dcfl-table1 --seeds 3 --out runs/repro
    python -m fedcluster.reproduce dcfl-table1-central --seeds 1 --out runs/repro
    python -m fedcluster.reproduce dcfl-table1-central-500 --seeds 1 --out runs/repro
    python -m fedcluster.reproduce dcfl-table2 --seeds 3 --out runs/repro
    python -m fedcluster.reproduce dcfl-fig5 --seeds 3 --out runs/repro
    python -m fedcluster.reproduce fedgroup-table1 --seeds 1 --out runs/repro
    python -m fedcluster.reproduce summarize --runs DIR[:SEEDS] [...] --last 10
    python -m fedcluster.reproduce jgl-fig4-mlp --seeds 3 --out runs/repro   # a CELLS entry

``CELLS`` are the scoreboard's cells run by this harness: each is a preset
with overrides, a default number of rounds (the paper's, or the stated
reduction) and the table's score; ``--rounds`` changes the rounds, ``--seeds``
the seeds.

``--first-seed K`` runs seeds K, K+1, ... (e.g. one seed per process),
``--algorithms A,B`` only those of its algorithms (e.g. one process
each), and ``summarize`` builds the table from run directories written that way.

Scores: ``final`` is the pooled test accuracy of the last round; ``max`` the
best over evaluated rounds (FedGroup's Table III); ``last-N`` the mean over
the evaluated rounds among the last N (CFLGT Table I: N = 20; FedGroup: 10);
``purity`` and ``ARI`` those of the last round's clusters against the true groups;
``clients final`` the mean ± std over clients of the last round's per-client
accuracy and ``clients average`` the same two values averaged over all
evaluated rounds (DCFL Tables I and II).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedcluster.config.schema import resolve_config
from fedcluster.experiment.rundir import job_summary
from fedcluster.experiment.runner import Experiment
from fedcluster.experiment.summary import format_table


def parser(description: str) -> argparse.ArgumentParser:
    """The options every reproduction run takes: seeds, rounds, data root, output."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--first-seed", type=int, default=0, help="seeds first .. first + seeds - 1")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--data-dir", default=None, help="dataset root (default $FEDCLUSTER_DATA)")
    p.add_argument("--out", default="runs/benchmarks")
    return p


def chosen_settings(p: argparse.ArgumentParser, text: str, known: Sequence[str]) -> list[str]:
    """The comma-separated setting names of ``text``; the parser's error (exit 2) naming
    any that ``known`` lacks."""
    chosen = text.split(",")
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        p.error(f"unknown settings {unknown}; choose from {list(known)}")
    return chosen


def write_results(out: Path, stem: str, jobs: list[Row], rows: list[Row]) -> str:
    """``out/STEM.json`` (the jobs and the table rows) and ``out/STEM.md`` (the table);
    the table's text."""
    save_json(out / f"{stem}.json", {"jobs": jobs, "table": rows})
    text = format_table(rows)
    (out / f"{stem}.md").write_text(text + "\n")
    return text


def run_setting(
    preset: str | None,
    sets: list[str],
    seeds: int,
    out: Path,
    data_dir: str | None,
    rounds: int | None = None,
    first_seed: int = 0,
    config_path: str | None = None,
    only: list[str] | None = None,
) -> list[dict]:
    """Run a preset (and/or a config file) with overrides for ``seeds`` seeds; job summaries.

    ``only`` keeps the algorithms of those labels or names, after ``sets`` (``--algorithms``).
    """
    overrides: dict[str, Any] = {
        "seeds": list(range(first_seed, first_seed + seeds)),
        "data": {"data_dir": data_dir},
    }
    if rounds is not None:
        overrides["rounds"] = rounds
    config = resolve_config(config_path, preset, sets, overrides)
    if only:
        keep = [a for a in config.algorithms if a.label in only or a.name in only]
        missing = set(only) - {a.label for a in keep} - {a.name for a in keep}
        if missing:
            raise SystemExit(f"--algorithms: no algorithm labelled or named {sorted(missing)}")
        config = config.model_copy(update={"algorithms": keep})
    results = Experiment(config).run(out, progress=False)
    summaries = [job_summary(j) for j in results]
    for s, j in zip(summaries, results, strict=True):
        s["rows"] = j.rows
    return summaries


def mean_std(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    """``mean ± std`` of the finite ``values`` times ``scale`` ("-" when there are none)."""
    vals = [v * scale for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return "-"
    return f"{np.mean(vals):.{digits}f} ± {np.std(vals):.{digits}f}"


def save_json(path: Path, payload: object) -> None:
    """``payload`` as indented JSON at ``path`` (floats for numpy scalars), folders made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=float))


Row = dict[str, Any]
"""A job summary or metrics row as JSON holds it (numbers, strings, nested rows)."""


def _evaluated(rows: list[Row]) -> list[Row]:
    return [r for r in rows if not math.isnan(float(r["accuracy"]))]


def first_round(rows: list[Row], key: str, target: float) -> float:
    """The first round whose ``key`` is at least ``target`` (nan: never)."""
    hits = [r["round"] for r in rows if not math.isnan(float(r[key])) and float(r[key]) >= target]
    return float(hits[0]) if hits else math.nan


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
        "to_purity": first_round(rows, "purity", 0.9),
    }


def reached(values: list[float]) -> str:
    """``mean ± std (k/n)`` over the seeds that reached a target (``never (0/n)``)."""
    hit = [v for v in values if not math.isnan(v)]
    counted = f"({len(hit)}/{len(values)})"
    return f"{mean_std(hit)} {counted}" if hit else f"never {counted}"


def score_table(
    jobs: list[Row], last: int, setting: str | None = None, acc_target: float | None = None
) -> list[Row]:
    """Mean ± std over seeds of each algorithm's scores.

    With ``acc_target``, also the rounds to that pooled test accuracy (JGL Fig. 4(c)).
    """
    table = []
    for alg in dict.fromkeys(j["algorithm"] for j in jobs):
        mine = [j["rows"] for j in jobs if j["algorithm"] == alg]
        s = [job_scores(rows, last) for rows in mine]

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
            "rounds to purity 0.9": "-"
            if col("purity") == "-"
            else reached([x["to_purity"] for x in s]),
            "epsilon": col("epsilon", 1, 2),
            "train s": col("seconds", 1, 0),
        }
        if acc_target is not None:
            key = f"rounds to acc {acc_target:g}"
            row[key] = reached([first_round(rows, "accuracy", acc_target) for rows in mine])
        table.append(row)
    return table


def _jobs(preset: str, sets: list[str], args, tag: str, rounds: int | None = None) -> list[Row]:
    if args.first_seed:
        tag = f"{tag}-from-seed-{args.first_seed}"
    only = args.algorithms.split(",") if args.algorithms else None
    if only:
        tag = f"{tag}-{'+'.join(only)}"
    out = Path(args.out) / tag
    rounds = args.rounds if args.rounds is not None else rounds
    sets = [*sets, *args.set]
    return run_setting(
        preset, sets, args.seeds, out, args.data_dir, rounds, args.first_seed, only=only
    )


def _run(preset: str, sets: list[str], args, tag: str, last: int, setting=None) -> list[Row]:
    return score_table(_jobs(preset, sets, args, tag), last, setting)


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


def fedgroup_table1(args) -> list[Row]:
    """FedGroup Table I: FedAvg (MCLR) on MNIST with 1, 3, 5 and 10 classes per client.

    Max and median pooled accuracy over the rounds and the first round at 85%; the
    discrepancy of eq. 4 (mean distance of the clients' models to the global one) is not
    logged by fedcluster.
    """
    table = []
    for k in (1, 3, 5, 10):
        sets = ["eval_every=1", f"data.partition.classes_per_client={k}", _algs("{name: fedavg}")]
        jobs = _jobs("fedgroup-mnist", sets, args, f"fedgroup-t1-{k}")
        row = score_table(jobs, 10, f"{k} classes", acc_target=0.85)[0]
        medians = [np.median([float(r["accuracy"]) for r in _evaluated(j["rows"])]) for j in jobs]
        row["median acc %"] = mean_std(medians, 100.0)
        table.append(row)
    return table


@dataclass(frozen=True)
class Cell:
    """One scoreboard cell group: a preset, overrides, default rounds and its score."""

    preset: str
    sets: tuple[str, ...]
    rounds: int
    last: int = 20
    acc_target: float | None = None
    clustering_round: int | None = None  # Fig. 8: report this round's costs
    curve: tuple[int, ...] = ()  # Fig. 4 of DCFL: mean client accuracy at these rounds


def _algs(*specs: str) -> str:
    return "algorithms=[" + ", ".join(specs) + "]"


JGL_PAIR = _algs(
    "{name: jgl, label: jgl-0.2, params: {n_clusters: 4, lam: 0.2, init: random}}",
    "{name: ifca, label: ifca, params: {n_clusters: 4, weighting: uniform, init: random}}",
)
# JGL Fig. 2 at the scale of docs/reproduction.md's JGL tables (global labels, random init).
JGL_MNIST = ("data.partition.scale=0.27", "data.partition.relabel=false", "eval_every=1", JGL_PAIR)
FG_EDC = "{name: fedgroup, label: fedgroup-edc, params: {n_groups: 3, measure: edc"
FG_EDC5 = FG_EDC.replace("n_groups: 3", "n_groups: 5")
FG_MADC = "{name: fedgroup, label: fedgroup-madc, params: {n_groups: 3, measure: madc}}"
FGP_MADC = "{{name: fedgrouprox, label: fgp-madc, params: {{n_groups: {m}, measure: madc}}}}"

CELLS: dict[str, Cell] = {
    # JGL Fig. 4(b)-(c): rounds to 0.8 test accuracy, MLP (the paper: 14% fewer for JGL).
    "jgl-fig4-mlp": Cell("jgl-mnist", JGL_MNIST, 40, acc_target=0.8),
    # JGL Fig. 4(d)-(f): the Fig. 3 CNN on the same table, at scale 0.1 (CNN cost).
    "jgl-fig4-cnn": Cell(
        "jgl-mnist",
        ("data.partition.scale=0.1", "data.partition.relabel=false", "eval_every=1")
        + ("model.name=cnn", "model.options={}", JGL_PAIR),
        15,
        acc_target=0.8,
    ),
    # JGL Fig. 5(c): EMNIST, 200 devices in 8 clusters of 40 classes.
    "jgl-fig5-emnist": Cell(
        "jgl-emnist",
        (
            "eval_every=1",
            _algs(
                "{name: jgl, label: jgl-0.2, params: {n_clusters: 8, lam: 0.2, init: random}}",
                "{name: ifca, label: ifca, params: {n_clusters: 8, weighting: uniform,"
                " init: random}}",
            ),
        ),
        16,
    ),
    # CFLGT Table I, Fashion-MNIST scenarios 2 and 3 (the preset's seven methods).
    "cflgt-fmnist-s2": Cell("cflgt-s2", ("eval_every=1",), 125),
    "cflgt-fmnist-s3": Cell("cflgt-s3", ("eval_every=1",), 125),
    # CFLGT Table II on Fashion-MNIST scenario 3: FL+HC given 10 and 30 clusters
    # (FL+HC(20) and CFLGT are cflgt-fmnist-s3's rows).
    "cflgt-table2-fmnist": Cell(
        "cflgt-s3",
        (
            "eval_every=1",
            _algs(
                "{name: flhc, label: flhc-10, params: {pretrain_rounds: 25, n_clusters: 10}}",
                "{name: flhc, label: flhc-30, params: {pretrain_rounds: 25, n_clusters: 30}}",
            ),
        ),
        125,
    ),
    # CFLGT Fig. 8: client and server time and upload of the clustering round
    # (round 26, after 25 pre-training rounds) on Fashion-MNIST scenario 3.
    "cflgt-fig8": Cell(
        "cflgt-s3",
        (
            "eval_every=1",
            _algs(
                "{name: cflgt, params: {pretrain_rounds: 25}}",
                "{name: flhc, params: {pretrain_rounds: 25, n_clusters: 20}}",
                "{name: fesem, params: {n_clusters: 20}}",
                "{name: ifca, params: {n_clusters: 20}}",
            ),
        ),
        27,
        clustering_round=26,
    ),
    # FedGroup Table III, MNIST-MLP column (one hidden layer of 128 units): the preset's
    # seven methods and the table's RCC, RAC and FGP-MADC.
    "fedgroup-mnist-mlp": Cell(
        "fedgroup-mnist",
        (
            "eval_every=1",
            "model.name=mlp",
            "model.options={hidden: [128]}",
            _algs(
                FG_EDC + "}}",
                FG_MADC,
                "{name: fedgrouprox, label: fgp-edc, params: {n_groups: 3}}",
                "{name: ifca, params: {n_clusters: 3}}",
                "{name: fesem, params: {n_clusters: 3}}",
                "{name: fedavg}",
                "{name: fedprox, params: {mu: 1.0}}",
                FG_EDC.replace("fedgroup-edc", "fg-rcc-edc") + ", rcc: true}}",
                FG_EDC.replace("fedgroup-edc", "fg-rac-edc") + ", rac: true}}",
                FGP_MADC.format(m=3),
            ),
        ),
        300,
        last=10,
    ),
    # FedGroup Table III, MNIST-MCLR: FGP-MADC (the preset's FedGrouProx uses EDC).
    "fedgroup-mnist-fgp-madc": Cell(
        "fedgroup-mnist", ("eval_every=1", _algs(FGP_MADC.format(m=3))), 300, last=10
    ),
    # FedGroup Table III, Synthetic(1,1)-MCLR: RCC, RAC, FG-MADC and FGP-MADC (m = 5).
    "fedgroup-synthetic-ablations": Cell(
        "fedgroup-synthetic",
        (
            "eval_every=1",
            _algs(
                FG_EDC5.replace("fedgroup-edc", "fg-rcc-edc") + ", rcc: true}}",
                FG_EDC5.replace("fedgroup-edc", "fg-rac-edc") + ", rac: true}}",
                FG_MADC.replace("n_groups: 3", "n_groups: 5"),
                FGP_MADC.format(m=5),
            ),
        ),
        200,
        last=10,
    ),
    # FedGroup Table III's ablations RCC and RAC, and the inter-group rate eta_g, MNIST-MCLR.
    "fedgroup-ablations": Cell(
        "fedgroup-mnist",
        (
            "eval_every=1",
            _algs(
                FG_EDC + "}}",
                FG_EDC.replace("fedgroup-edc", "fg-rcc-edc") + ", rcc: true}}",
                FG_EDC.replace("fedgroup-edc", "fg-rac-edc") + ", rac: true}}",
                FG_EDC.replace("fedgroup-edc", "fg-edc-eta0.1") + ", eta_g: 0.1}}",
            ),
        ),
        300,
    ),
    # FedGroup's newcomers: 100 clients at the start, 900 joining (client cold start, eq. 9).
    "fedgroup-newcomers": Cell("fedgroup-newcomers", ("eval_every=1",), 300, last=10),
    # DCFL Fig. 4: the per-round curves of Table I (DCFL, CFL, FedAvg), without DP (with the
    # preset's client-level DP every curve stays at chance, docs/reproduction.md Table I).
    "dcfl-fig4": Cell(
        "dcfl-emnist-dynamic",
        ("eval_every=1", "privacy.mode=none"),
        60,
        last=10,
        curve=(1, 5, 10, 20, 30, 40, 50, 60),
    ),
}


# The scoreboard's column of each cell's table and its methods in the paper's order
# (docs/reproduction.md's rows: C8, C9-C15, C19, G11, G12, G18, G24, J4, D8).
PAPER_ORDER: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "cflgt-fmnist-s2": (
        ("last-20 acc %",),
        ("fedavg", "fedavg-ft", "fedprox", "fesem", "flhc", "ifca", "cflgt"),
    ),
    "cflgt-fmnist-s3": (
        ("last-20 acc %",),
        ("cflgt", "ifca", "flhc", "fesem", "fedavg", "fedavg-ft", "fedprox"),
    ),
    "cflgt-table2-fmnist": (("last-20 acc %",), ("flhc-10", "flhc-30")),
    "fedgroup-mnist-mlp": (
        ("max acc %",),
        (
            "fedavg",
            "fedprox",
            "ifca",
            "fesem",
            "fg-rcc-edc",
            "fg-rac-edc",
            "fedgroup-edc",
            "fgp-edc",
            "fedgroup-madc",
            "fgp-madc",
        ),
    ),
    "fedgroup-mnist-fgp-madc": (("max acc %",), ("fgp-madc",)),
    "fedgroup-synthetic-ablations": (
        ("max acc %",),
        ("fg-rcc-edc", "fg-rac-edc", "fedgroup-madc", "fgp-madc"),
    ),
    "fedgroup-newcomers": (
        ("max acc %", "last-10 acc %"),
        ("fedgroup-edc", "fedgroup-madc", "fedgrouprox", "ifca", "fesem", "fedavg"),
    ),
    "jgl-fig4-cnn": (("rounds to purity 0.9", "rounds to acc 0.8", "purity"), ("jgl-0.2", "ifca")),
    "dcfl-fig4": (("clients final", "clients average"), ("dcfl", "cfl", "fedavg")),
}


def paper_order_lines(cell: str, table: list[Row]) -> list[str]:
    """The scoreboard's numbers of a cell: per column, its methods in the paper's order
    (``name value`` joined by `` / ``; ``-`` for a method with no row)."""
    if cell not in PAPER_ORDER:
        return []
    columns, order = PAPER_ORDER[cell]
    rows = {str(r["algorithm"]): r for r in table}
    lines = []
    for column in columns:
        values = [
            f"{a} {rows[a][column]} ({rows[a]['seeds']}; {rows[a].get('rounds', '')})"
            if a in rows
            else f"{a} -"
            for a in order
        ]
        lines.append(f"{column}: " + " / ".join(values))
    return lines


def run_cell(name: str, args) -> list[Row]:
    """Run one of ``CELLS`` and return its score table (Fig. 8: the clustering round's costs)."""
    cell = CELLS[name]
    return cell_table(cell, _jobs(cell.preset, list(cell.sets), args, name, cell.rounds))


def cell_table(cell: Cell, jobs: list[Row]) -> list[Row]:
    """A cell's score table from its jobs (algorithm, seed, metric rows)."""
    if cell.clustering_round is None:
        table = score_table(jobs, cell.last, acc_target=cell.acc_target)
        for row in table:
            mine = [j["rows"] for j in jobs if j["algorithm"] == row["algorithm"]]
            for rnd in cell.curve:
                at = [float(r["accuracy_mean"]) for rows in mine for r in rows if r["round"] == rnd]
                row[f"clients @{rnd}"] = mean_std(at, 1, 2)
        return table
    table = []
    for job in jobs:
        row = next(r for r in job["rows"] if r["round"] == cell.clustering_round)
        later = [r for r in job["rows"] if r["round"] > cell.clustering_round]
        table.append(
            {
                "algorithm": job["algorithm"],
                "seed": str(job["seed"]),
                f"client s, round {cell.clustering_round}": f"{row['client_seconds']:.2f}",
                f"server s, round {cell.clustering_round}": f"{row['server_seconds']:.3f}",
                f"KB up, round {cell.clustering_round}": f"{row['bytes_up'] / 1e3:.1f}",
                "client s per later round": f"{np.mean([r['client_seconds'] for r in later]):.2f}",
                "server s per later round": f"{np.mean([r['server_seconds'] for r in later]):.3f}",
            }
        )
    return table


def load_jobs(runs: list[str]) -> list[Row]:
    """Jobs (algorithm, seed, metric rows) read back from run directories' ``metrics.csv``.

    A run given as ``DIR:0,1`` contributes only seeds 0 and 1. A job (algorithm label,
    seed) found in two runs is refused: its rows would be pooled into one wrong score.
    """
    jobs: dict[tuple[str, int], list[Row]] = {}
    source: dict[tuple[str, int], str] = {}
    for run in runs:
        run_dir, _, only = run.partition(":")
        seeds = {int(s) for s in only.split(",")} if only else None
        with open(Path(run_dir) / "metrics.csv", newline="") as f:
            for r in csv.DictReader(f):
                if seeds is not None and int(r["seed"]) not in seeds:
                    continue
                key = (r["algorithm"], int(r["seed"]))
                if source.setdefault(key, run_dir) != run_dir:
                    raise ValueError(
                        f"{key[0]} seed {key[1]} is in both {source[key]} and {run_dir}: "
                        "summarize them apart, or keep one's seeds with DIR:SEEDS"
                    )
                row: Row = {
                    k: float(v) if v else math.nan for k, v in r.items() if k != "algorithm"
                }
                row["round"] = int(r["round"])
                jobs.setdefault(key, []).append(row)
    return [{"algorithm": a, "seed": s, "rows": rows} for (a, s), rows in jobs.items()]


def rounds_reached(jobs: list[Row]) -> dict[str, str]:
    """Per algorithm, the last round its seeds reached (``min-max`` where they differ)."""
    reached: dict[str, list[int]] = {}
    for job in jobs:
        reached.setdefault(str(job["algorithm"]), []).append(int(job["rows"][-1]["round"]))
    return {a: "-".join(dict.fromkeys(map(str, (min(r), max(r))))) for a, r in reached.items()}


def up_to(jobs: list[Row], upto: int | None) -> list[Row]:
    """The jobs' rows up to round ``upto`` (all with None); jobs left with no row dropped."""
    if upto is not None:
        jobs = [j | {"rows": [r for r in j["rows"] if r["round"] <= upto]} for j in jobs]
    return [j for j in jobs if j["rows"]]


def scoreboard_tables(folder: Path, upto: int | None = None) -> dict[str, list[Row]]:
    """The cells' score tables from the output of ``benchmarks/gpu/scoreboard_cpu.sh``.

    ``folder`` holds its ``jobs.txt`` (job name, cell, ...) and ``runs/<job>/``; the jobs of
    a cell are merged and scored as :func:`run_cell` scores them, each row with the rounds
    its seeds reached and the job's planned rounds (a job cut by the deadline stops early).
    ``upto`` keeps rounds up to that one (a common round for jobs cut at different rounds).
    """
    by_cell: dict[str, list[str]] = {}
    planned: dict[tuple[str, str], str] = {}  # (cell, algorithm label): the job's rounds
    for line in (folder / "jobs.txt").read_text().splitlines():
        name, cell, _, algorithms, rounds = line.split()[:5]
        planned |= {(cell, a): rounds for a in algorithms.split(",")}
        runs = sorted(str(p.parent) for p in (folder / "runs" / name).glob("*/metrics.csv"))
        by_cell.setdefault(cell, []).extend(runs)
    tables = {}
    for cell, runs in by_cell.items():
        jobs = up_to(load_jobs(runs), upto)
        if not jobs:
            continue
        jobs.sort(key=lambda j: (str(j["algorithm"]), int(j["seed"])))
        reached = rounds_reached(jobs)
        table = cell_table(CELLS[cell], jobs)
        for row in table:
            alg = str(row["algorithm"])
            row["rounds"] = f"{reached[alg]}/{planned.get((cell, alg), '?')}"
        tables[cell] = table
    return tables


EXPERIMENTS: dict[str, Callable] = {
    "cflgt-s1": cflgt_s1,
    "fedgroup-mnist": fedgroup_mnist,
    "fedgroup-synthetic": fedgroup_synthetic,
    "dcfl-table1": dcfl_table1,
    "dcfl-table1-central": dcfl_table1_central,
    "dcfl-table1-central-500": dcfl_table1_central_500,
    "dcfl-table2": dcfl_table2,
    "dcfl-fig5": dcfl_fig5,
    "fedgroup-table1": fedgroup_table1,
}


def main() -> None:
    p = parser(__doc__)
    p.add_argument(
        "experiment", choices=[*sorted(EXPERIMENTS), *sorted(CELLS), "summarize", "scoreboard"]
    )
    p.add_argument("--runs", nargs="*", default=[], help="summarize: run directories [DIR:SEEDS]")
    p.add_argument("--last", type=int, default=10, help="summarize: N of the last-N score")
    p.add_argument(
        "--upto",
        type=int,
        default=None,
        help="summarize, scoreboard: only rounds up to this one (a round every job reached)",
    )
    p.add_argument(
        "--folder",
        default=None,
        help="scoreboard: the unpacked scoreboard.tgz of benchmarks/gpu/scoreboard_cpu.sh",
    )
    p.add_argument(
        "--algorithms",
        default="",
        help="comma-separated labels or names: run only these of the experiment's algorithms "
        "(e.g. one process each; 'summarize' merges the run directories)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override after the experiment's own (repeatable; e.g. a smaller scale)",
    )
    args = p.parse_args()
    if args.experiment == "scoreboard":
        if args.folder is None:
            raise SystemExit("scoreboard: --folder names the unpacked scoreboard.tgz")
        tables = scoreboard_tables(Path(args.folder), args.upto)
        save_json(Path(args.out) / "scoreboard.json", tables)
        for cell, table in tables.items():
            print(f"\n{cell} ({CELLS[cell].preset}; rounds: reached / planned)")
            print(format_table(table))
            print("\n".join(paper_order_lines(cell, table)))
        return
    if args.experiment == "summarize":
        try:
            jobs = load_jobs(args.runs)
        except ValueError as exc:
            raise SystemExit(f"summarize: {exc}") from None
        table = score_table(up_to(jobs, args.upto), args.last)
    elif args.experiment in CELLS:
        table = run_cell(args.experiment, args)
    else:
        table = EXPERIMENTS[args.experiment](args)
    save_json(Path(args.out) / f"{args.experiment}.json", table)
    print(format_table(table))


if __name__ == "__main__":
    main()
