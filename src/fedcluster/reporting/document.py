"""The report's content, independent of its format: sections of text, figures and tables.

:func:`build_sections` decides what a set of runs shows: accuracy, clustering
quality (purity as in JGL Sec. III-A-3, ARI, cluster count) and assignment
heatmaps only when some algorithm clusters, ε only when local DP was on
(:mod:`fedcluster.privacy.ledger`), the events timeline only when ``events.csv`` has
rows (a dynamic federation, :mod:`fedcluster.experiment.scenario`), algorithm diagnostics
only when ``diagnostics.csv`` has rows, per-group accuracy, the worst clients
and accuracy against cluster size when ``clients.csv`` has rows, the test-time
cluster choices only when
``assign.csv`` has rows (:mod:`fedcluster.experiment.cluster_choice`). The writers
(:mod:`fedcluster.reporting.writers`) render the same sections as HTML and
Markdown.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pandas as pd

from fedcluster.experiment.summary import summary_rows
from fedcluster.reporting import clients, figures
from fedcluster.reporting.rundata import RunData


@dataclass
class Section:
    """One part of the report; ``key`` is its HTML id and the stem of its PNG file."""

    key: str
    title: str
    text: str = ""
    image: bytes | None = None
    tables: list[tuple[str, list[dict[str, str]]]] = field(default_factory=list)
    code: str | None = None


class _Plot(NamedTuple):
    key: str
    title: str
    draw: Callable[[list[Any], list[RunData]], Any]  # (entries, runs) -> Figure | None
    text: str


# the figure sections, in reading order; a figure that has nothing to show is None
_PLOTS = (
    _Plot(
        "accuracy",
        "Accuracy over rounds",
        lambda items, runs: figures.accuracy(items),
        "Left: test accuracy over all clients' test samples, each client using the model it "
        "would use (line: mean over seeds, band: min to max). Right: mean ± std of the "
        "per-client accuracies.",
    ),
    _Plot(
        "clustering",
        "Clustering quality",
        lambda items, runs: figures.clustering(items),
        "Purity and adjusted Rand index of the clients' clusters against the true groups, "
        "and how many clusters are in use (algorithms that cluster clients).",
    ),
    _Plot(
        "clusters",
        "Cluster assignments",
        lambda items, runs: figures.heatmaps(items),
        "One row per client, sorted by true group (black lines between groups); the colour is "
        "the cluster the client is in at each round (white: in no cluster: absent, or before "
        "the algorithm clustered). Groups that share a colour were merged; "
        "a group with several colours was split.",
    ),
    _Plot(
        "communication",
        "Accuracy against communication",
        lambda items, runs: figures.communication(items),
        "Test accuracy against the megabytes sent so far, uploads plus downloads, counted "
        "where sent.",
    ),
    _Plot(
        "privacy",
        "Privacy spent",
        lambda items, runs: figures.epsilon(items),
        "Local differential privacy: the largest ε any client has spent so far, at the "
        "configured δ.",
    ),
    _Plot(
        "events",
        "Events",
        lambda items, runs: figures.events(runs),
        "Dynamic federation: clients joining, leaving, failing to reply, drifting, and uploads "
        "the server rejected.",
    ),
    _Plot(
        "select-k",
        "Choosing K",
        lambda items, runs: figures.select_k(items),
        "n_clusters: auto: the mean silhouette of k-means on the clients' warm-up updates "
        "for each K of the range (select_k.csv); the largest is chosen (ringed). "
        "docs/clustering.md describes the criterion.",
    ),
    _Plot(
        "diagnostics",
        "Algorithm diagnostics",
        lambda items, runs: figures.diagnostics(items),
        "Quantities the algorithms report about their own state (diagnostics.csv).",
    ),
)


def build_sections(runs: list[RunData]) -> list[Section]:
    """Every section the runs have content for, in reading order."""
    out = [_table(runs), *_plot_sections(runs), *_client_sections(runs)]
    if any(r.assign for r in runs):
        out.append(_assign_section(runs))
    return out + _config_sections(runs, first=len(out))


def _plot_sections(runs: list[RunData]) -> list[Section]:
    items = figures.entries(runs)
    out = []
    for plot in _PLOTS:
        fig = plot.draw(items, runs)
        if fig is None:
            continue
        section = Section(plot.key, plot.title, plot.text, figures.png(fig))
        if plot.key == "events":
            section.tables = [(r.name, _event_counts(r)) for r in runs if r.events]
        if plot.key == "select-k":
            section.tables = [(r.name, _k_curves(r)) for r in runs if r.select_k]
        out.append(section)
    return out


def _assign_section(runs: list[RunData]) -> Section:
    from fedcluster.experiment.cluster_choice import (
        summarise,  # imports torch: only when needed
    )

    choices = [(r.name if len(runs) > 1 else "", summarise(r.assign)) for r in runs if r.assign]
    return Section(
        "assign",
        "Cluster choice for held-out devices",
        "fedcluster assign --record: per algorithm and true group of the devices, the "
        "mean accuracy of the cluster model each rule chose (entropy, confidence, "
        "descriptor for FLUX runs: without labels; loss: with labels), and how often a "
        "label-free rule chose the labelled rule's model (fedcluster.experiment.cluster_choice).",
        tables=choices,
    )


def _config_sections(runs: list[RunData], first: int) -> list[Section]:
    """Each run's resolved config; with several runs their keys go on from ``first``."""
    out = []
    for i, run in enumerate(runs):
        title = "Configuration" + ("" if len(runs) == 1 else f": {run.name}")
        key = "config" if len(runs) == 1 else f"config-{first + i}"
        text = f"The resolved config.yaml of {run.path}."
        out.append(Section(key, title, text, code=run.config_text))
    return out


def _client_sections(runs: list[RunData]) -> list[Section]:
    """Per-group accuracy, the worst 10% of clients and accuracy against cluster size, from
    ``clients.csv`` (:mod:`fedcluster.reporting.clients`); none for runs without it."""
    finals = [(r.name if len(runs) > 1 else "", clients.last_round(r)) for r in runs]
    finals = [(name, final) for name, final in finals if not final.empty]
    if not finals:
        return []
    out = []
    groups = [(name, clients.group_accuracy(final)) for name, final in finals]
    if any(rows for _, rows in groups):
        out.append(
            Section(
                "groups",
                "Accuracy per group",
                "Each true group's test accuracy over its clients' test samples, every client "
                "using the model it would use, at the last evaluation round (mean over seeds).",
                tables=[(name, rows) for name, rows in groups if rows],
            )
        )
    out.append(
        Section(
            "worst-clients",
            "Worst clients",
            "The mean test accuracy of the worst 10% of clients (at least one), the lowest and "
            "the mean client accuracy at the last evaluation round (mean over seeds), and which "
            "clients those are (clients.csv has every client).",
            tables=[(name, clients.worst_clients(final)) for name, final in finals],
        )
    )
    sized = []
    for name, final in finals:
        mine = clients.cluster_sizes(final)
        if name:  # the same algorithm of two runs, told apart
            mine["algorithm"] = name + ": " + mine["algorithm"]
        sized.append(mine)
    sizes = pd.concat(sized)
    fig = clients.size_figure(sizes)
    if fig is not None:
        out.append(
            Section(
                "cluster-size",
                "Accuracy against cluster size",
                "Each client's test accuracy at the last evaluation round against how many "
                "clients share its cluster (dots; line: the mean per size), for the methods "
                "that cluster clients.",
                figures.png(fig),
            )
        )
    return out


def _table(runs: list[RunData]) -> Section:
    tables = []
    for run in runs:
        jobs = run.summary.get("jobs") or []
        rows = summary_rows(jobs) if jobs else []
        tables.append((run.name if len(runs) > 1 else "", rows))
    text = (
        "final acc: test accuracy over all clients' test samples after the last round; "
        "client acc: mean ± std over clients; purity: the clusters against the true groups "
        "(JGL Sec. III-A-3); mean ± std over seeds where there are several."
    )
    if any(not rows for _, rows in tables):
        text += " A run without summary.json has not finished; its table is empty."
    return Section("summary", "Results", text, tables=tables)


def _event_counts(run: RunData) -> list[dict[str, str]]:
    counts: dict[tuple[str, str], Counter] = {}
    kinds: list[str] = []
    for ev in run.events:
        counts.setdefault((ev["algorithm"], ev["seed"]), Counter())[ev["kind"]] += 1
        if ev["kind"] not in kinds:
            kinds.append(ev["kind"])
    return [
        {"algorithm": alg, "seed": seed, **{k: str(c[k]) for k in kinds}}
        for (alg, seed), c in counts.items()
    ]


def _k_curves(run: RunData) -> list[dict[str, str]]:
    """One row per ``n_clusters: auto`` job: the chosen K and the criterion at each K."""
    jobs: dict[tuple[str, str], list[dict[str, str]]] = {}
    for r in run.select_k:
        jobs.setdefault((r["algorithm"], r["seed"]), []).append(r)
    ks = sorted({int(r["k"]) for r in run.select_k})
    out = []
    for (alg, seed), job in jobs.items():
        value = {int(r["k"]): float(r["value"]) for r in job}
        chosen = [r["k"] for r in job if r["chosen"] == "1"]
        row = {"algorithm": alg, "seed": seed, "parameter": job[0]["parameter"]}
        row["chosen K"] = chosen[0] if chosen else "-"
        row.update({f"K={k}": f"{value[k]:.3f}" if k in value else "-" for k in ks})
        out.append(row)
    return out
