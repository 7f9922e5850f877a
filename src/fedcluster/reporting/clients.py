"""The report's per-client views, from ``clients.csv``
(:mod:`fedcluster.experiment.client_results`).

Clustered FL is judged by how each client fares, not only by the pooled mean:
per-group accuracy (does every hidden group get a model that fits it?), the
worst 10% of clients (a fairness view: the mean accuracy of the clients the
federation serves worst, as in Li et al., "Fair Resource Allocation in
Federated Learning", ICLR 2020, Sec. 5, which reports the worst 10%), and
accuracy against the size of the client's cluster (do small clusters, trained
on fewer clients' data, fall behind?). All three use each job's last
evaluation round; over seeds they are averaged.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from fedcluster.experiment.client_results import read_clients
from fedcluster.reporting.figures import _subplots
from fedcluster.reporting.rundata import RunData

WORST_FRACTION = 0.1


def last_round(run: RunData) -> pd.DataFrame:
    """The rows of ``clients.csv`` at each (algorithm, seed) job's last evaluation round,
    with ``correct`` (accuracy × samples)."""
    clients = read_clients(run.path)
    if clients.empty:
        return clients
    last = clients.groupby(["algorithm", "seed"])["round"].transform("max")
    final = clients[clients["round"] == last].copy()
    final["correct"] = (final["accuracy"].fillna(0.0) * final["samples"]).round()
    return final


def group_accuracy(final: pd.DataFrame) -> list[dict[str, str]]:
    """Per algorithm, each true group's pooled test accuracy (%), mean over seeds."""
    known = final[final["group"].notna()]
    if known.empty:
        return []
    pooled = known.groupby(["algorithm", "seed", "group"])[["correct", "samples"]].sum()
    accuracy = (pooled["correct"] / pooled["samples"]).groupby(["algorithm", "group"]).mean()
    groups = sorted(int(g) for g in known["group"].unique())
    rows = []
    for algorithm in dict.fromkeys(known["algorithm"]):
        row = {"algorithm": algorithm}
        for g in groups:
            value = accuracy.get((algorithm, g), math.nan)
            row[f"group {g}"] = "-" if math.isnan(value) else f"{100 * value:.1f}"
        rows.append(row)
    return rows


def worst_rows(job: pd.DataFrame, fraction: float = WORST_FRACTION) -> pd.DataFrame:
    """One job's rows of its worst ``fraction`` of tested clients (at least one), lowest
    accuracy first (ties by client id)."""
    ranked = job[job["samples"] > 0].sort_values(["accuracy", "client"])
    return ranked.iloc[: max(1, math.ceil(fraction * len(ranked)))]


def worst_clients(final: pd.DataFrame, fraction: float = WORST_FRACTION) -> list[dict[str, str]]:
    """Per algorithm: the mean accuracy (%) of the worst ``fraction`` of clients (at least
    one), the lowest client accuracy and the mean over all clients, each averaged over
    seeds; and the worst clients of the first seed."""
    tested = final[final["samples"] > 0]
    rows = []
    for algorithm, mine in tested.groupby("algorithm", sort=False):
        worst, lowest, mean, names = [], [], [], ""
        for seed, job in mine.groupby("seed"):
            shown = worst_rows(job, fraction)
            worst.append(shown["accuracy"].mean())
            lowest.append(shown["accuracy"].iloc[0])
            mean.append(job["accuracy"].mean())
            if not names:
                pairs = zip(shown.client, shown.accuracy, strict=True)
                listed = (f"{c} ({100 * a:.0f}%)" for c, a in pairs)
                names = ", ".join(listed) + f" (seed {seed})"
        rows.append(
            {
                "algorithm": str(algorithm),
                "clients": str(mine["client"].nunique()),
                f"worst {100 * fraction:.0f}% acc %": f"{100 * np.mean(worst):.1f}",
                "lowest acc %": f"{100 * np.mean(lowest):.1f}",
                "mean acc %": f"{100 * np.mean(mean):.1f}",
                "worst clients": names,
            }
        )
    return rows


def cluster_sizes(final: pd.DataFrame) -> pd.DataFrame:
    """The rows of clustered methods' clients with ``size``: how many clients share the
    client's cluster in that job."""
    clustered = final[final["cluster"].notna()]
    clustered = clustered[clustered["cluster"] >= 0].copy()
    sizes = clustered.groupby(["algorithm", "seed", "cluster"])["client"].transform("count")
    clustered["size"] = sizes
    return clustered


def size_figure(clustered: pd.DataFrame) -> Figure | None:
    """Each client's accuracy against its cluster's size; a line through the mean per size."""
    if clustered.empty:
        return None
    fig, ax = _subplots(figsize=(6.4, 3.6), constrained_layout=True)
    for i, (algorithm, mine) in enumerate(clustered.groupby("algorithm", sort=False)):
        color = f"C{i % 10}"
        ax.scatter(mine["size"], 100 * mine["accuracy"], s=12, alpha=0.5, color=color)
        means = mine.groupby("size")["accuracy"].mean()
        ax.plot(means.index, 100 * means.values, "-o", color=color, label=str(algorithm))
    ax.set_xlabel("clients in the client's cluster")
    ax.set_ylabel("client test accuracy %")
    ax.legend(fontsize="small")
    return fig
