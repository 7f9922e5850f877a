"""The report's figures, drawn with matplotlib's Agg canvas (no display needed).

Each function takes the report's entries (one per algorithm of each run) and
returns a :class:`matplotlib.figure.Figure`, or None when the runs hold nothing
to draw; :func:`png` turns a figure into PNG bytes. Accuracy, purity and ARI
are the columns of :mod:`fedcluster.experiment.metrics` (purity as in JGL Sec. III-A-3);
a band is the min–max over seeds around their mean.

Figures are :class:`matplotlib.figure.Figure` objects on an Agg canvas, made
without pyplot: importing this module leaves matplotlib's backend and pyplot's
figures as they were (a notebook's inline plots keep working).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fedcluster.reporting.rundata import RunData

DPI = 96
_EVENT_STYLE = {  # kind -> (marker, colour)
    "join": ("^", "tab:green"),
    "leave": ("v", "tab:red"),
    "failed": ("x", "tab:gray"),
    "drift": ("D", "tab:purple"),
    "rejected": ("s", "tab:orange"),
    "faulty": ("*", "black"),
}


@dataclass(frozen=True)
class Entry:
    """One algorithm of one run as the report shows it: ``name`` in legends, its colour."""

    name: str
    run: RunData
    label: str
    color: str


def _subplots(*args: Any, figsize: tuple[float, float], **kwargs: Any) -> tuple[Figure, Any]:
    """A figure on its own Agg canvas and its axes (``pyplot.subplots`` without pyplot)."""
    fig = Figure(
        figsize=figsize, layout="constrained" if kwargs.pop("constrained_layout", False) else None
    )
    FigureCanvasAgg(fig)
    return fig, fig.subplots(*args, **kwargs)


def _palette(name: str) -> list[Any]:
    """The colours of matplotlib's qualitative colormap ``name``, in order."""
    cmap = matplotlib.colormaps[name]
    assert isinstance(cmap, ListedColormap), f"{name} is not a list of colours"
    return [cmap(i) for i in range(cmap.N)]


def entries(runs: list[RunData]) -> list[Entry]:
    """All algorithms of all runs; names carry the run's name when there are several runs."""
    colors = _palette("tab10") + _palette("Dark2")
    out: list[Entry] = []
    for run in runs:
        for label in run.labels:
            name = label if len(runs) == 1 else f"{run.name}: {label}"
            out.append(Entry(name, run, label, matplotlib.colors.to_hex(colors[len(out) % 18])))
    return out


def png(fig: Figure) -> bytes:
    """The figure as PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


def _band(ax, entry: Entry, column: str, scale: float = 1.0) -> bool:
    rounds, values = entry.run.column(entry.label, column)
    values = values * scale
    ok = np.isfinite(values).any(axis=0)
    if not ok.any():
        return False
    r, v = rounds[ok], values[:, ok]
    with np.errstate(all="ignore"):
        mean = np.nanmean(v, axis=0)
        lo, hi = np.nanmin(v, axis=0), np.nanmax(v, axis=0)
    ax.plot(r, mean, color=entry.color, label=entry.name, lw=1.6)
    if v.shape[0] > 1:
        ax.fill_between(r, lo, hi, color=entry.color, alpha=0.18, lw=0)
    return True


def _legend(fig: Figure, axes) -> None:
    handles, names = [], []
    for ax in np.ravel(axes):
        for h, n in zip(*ax.get_legend_handles_labels(), strict=True):
            if n not in names:
                handles.append(h)
                names.append(n)
    if handles:
        fig.legend(
            handles, names, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False, fontsize=8
        )
    for ax in np.ravel(axes):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _grid(n: int, height: float) -> tuple[Figure, np.ndarray]:
    """A figure with ``n`` panels, at most three a row (unused panels hidden)."""
    ncols = min(3, n)
    nrows = -(-n // ncols)
    fig, axes = _subplots(
        nrows, ncols, figsize=(4.2 * ncols, height * nrows), squeeze=False, constrained_layout=True
    )
    for ax in axes.flat[n:]:
        ax.axis("off")
    return fig, axes


def accuracy(items: list[Entry]) -> Figure | None:
    """Pooled test accuracy per round (mean, min–max band over seeds) and client mean ± std."""
    fig, (ax1, ax2) = _subplots(1, 2, figsize=(10, 3.6), sharey=True)
    drawn = False
    for e in items:
        drawn |= _band(ax1, e, "accuracy", 100)
        rounds, mean = e.run.column(e.label, "accuracy_mean")
        _, std = e.run.column(e.label, "accuracy_std")
        ok = np.isfinite(mean).any(axis=0)
        if ok.any():
            with np.errstate(all="ignore"):
                m, s = 100 * np.nanmean(mean[:, ok], 0), 100 * np.nanmean(std[:, ok], 0)
            ax2.plot(rounds[ok], m, color=e.color, label=e.name, lw=1.6)
            ax2.fill_between(rounds[ok], m - s, m + s, color=e.color, alpha=0.15, lw=0)
    if not drawn:
        return None
    ax1.set(title="test accuracy, all test samples", xlabel="round", ylabel="accuracy %")
    ax2.set(title="per-client accuracy, mean ± std over clients", xlabel="round")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    _legend(fig, (ax1, ax2))
    return fig


def clustering(items: list[Entry]) -> Figure | None:
    """Purity, ARI and the number of clusters per round, for algorithms that cluster."""
    items = [e for e in items if np.isfinite(e.run.column(e.label, "n_clusters")[1]).any()]
    if not items:
        return None
    fig, axes = _subplots(1, 3, figsize=(12, 3.4))
    for e in items:
        _band(axes[0], e, "purity")
        _band(axes[1], e, "ari")
        _band(axes[2], e, "n_clusters")
    axes[0].set(title="purity (vs true groups)", xlabel="round", ylim=(0, 1.05))
    axes[1].set(title="adjusted Rand index", xlabel="round", ylim=(-0.1, 1.05))
    axes[2].set(title="number of clusters", xlabel="round")
    axes[2].yaxis.get_major_locator().set_params(integer=True)
    for ax in axes:
        ax.grid(alpha=0.3)
    _legend(fig, axes)
    return fig


def _cluster_colors(n: int) -> ListedColormap:
    base = _palette("tab10") + _palette("tab20b")
    return ListedColormap(["#ffffff"] + [base[i % len(base)] for i in range(max(n, 1))])


def heatmaps(items: list[Entry]) -> Figure | None:
    """Cluster assignment per client (rows, sorted by true group) and round, first seed.

    Colour = the chosen cluster (white: in no cluster, i.e. absent or not yet
    clustered). Cluster ids are renumbered by first appearance in the sorted
    table, so colours are stable; lines and tick labels mark the true groups.
    """
    jobs = []
    for e in items:
        seed = next((s for s in e.run.seeds if (e.label, s) in e.run.clusters), None)
        if seed is not None:
            jobs.append((e, seed, e.run.clusters[(e.label, seed)]))
    if not jobs:
        return None
    fig, axes = _grid(len(jobs), 3.2)
    for ax, (e, seed, c) in zip(axes.flat, jobs, strict=False):
        order = np.lexsort((c["clients"], c["groups"]))
        assign, groups = c["assign"][order], c["groups"][order]
        ids = [a for a in dict.fromkeys(assign.T.ravel()) if a >= 0]
        image = np.zeros(assign.shape, dtype=int)
        for i, a in enumerate(ids):
            image[assign == a] = i + 1
        rounds = c["rounds"]
        extent = (rounds[0] - 0.5, rounds[-1] + 0.5, len(order) - 0.5, -0.5)
        ax.imshow(
            image,
            aspect="auto",
            interpolation="nearest",
            cmap=_cluster_colors(len(ids)),
            vmin=0,
            vmax=max(len(ids), 1),
            extent=extent,
        )
        if (groups >= 0).any():
            bounds = np.flatnonzero(np.diff(groups)) + 0.5
            for b in bounds:
                ax.axhline(b, color="black", lw=0.8)
            mids = [np.mean(np.flatnonzero(groups == g)) for g in np.unique(groups)]
            ax.set_yticks(mids, [f"group {g}" for g in np.unique(groups)], fontsize=8)
        else:
            ax.set_ylabel("client")
        seed_note = f" (seed {seed})" if len(e.run.seeds) > 1 else ""
        ax.set_title(f"{e.name}{seed_note}", fontsize=10)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(
        "cluster chosen by each client (colour), clients sorted by true group", fontsize=10
    )
    return fig


def communication(items: list[Entry]) -> Figure | None:
    """Test accuracy against cumulative megabytes sent up and down (mean over seeds)."""
    fig, ax = _subplots(figsize=(6, 3.6))
    drawn = False
    for e in items:
        rounds, acc = e.run.column(e.label, "accuracy")
        _, up = e.run.column(e.label, "bytes_up")
        _, down = e.run.column(e.label, "bytes_down")
        ok = np.isfinite(acc).any(axis=0)  # the evaluated rounds
        with np.errstate(all="ignore"):
            mb = np.nanmean(np.cumsum(np.nan_to_num(up + down), axis=1), 0) / 1e6
        if ok.any() and mb[-1] > 0:
            a = 100 * np.nanmean(acc[:, ok], 0)
            ax.plot(mb[ok], a, color=e.color, label=e.name, lw=1.6, marker=".", ms=3)
            drawn = True
    if not drawn:
        return None
    ax.set(
        title="accuracy against communication",
        xlabel="cumulative MB (up + down)",
        ylabel="accuracy %",
    )
    ax.grid(alpha=0.3)
    _legend(fig, ax)
    ax.xaxis.set_major_locator(MaxNLocator())
    return fig


def epsilon(items: list[Entry]) -> Figure | None:
    """ε spent so far (the largest over clients) per round, for runs with local DP."""
    items = [e for e in items if e.run.private]
    fig, ax = _subplots(figsize=(6, 3.4))
    drawn = False
    for e in items:
        drawn |= _band(ax, e, "epsilon")
    if not drawn:
        return None
    for run in {id(e.run): e.run for e in items}.values():
        target = (run.config.get("privacy") or {}).get("epsilon")
        if target is not None:
            ax.axhline(target, color="black", ls="--", lw=0.8)
    ax.set(
        title="privacy spent: largest ε over clients (dashed: target)", xlabel="round", ylabel="ε"
    )
    ax.grid(alpha=0.3)
    _legend(fig, ax)
    return fig


def events(runs: list[RunData]) -> Figure | None:
    """Events of dynamic runs (first seed): who joined, left, failed, drifted, was rejected."""
    shown = [r for r in runs if r.events]
    if not shown:
        return None
    fig, axes = _subplots(
        1, len(shown), figsize=(6.5 * len(shown), 3.6), squeeze=False, constrained_layout=True
    )
    for ax, run in zip(axes.flat, shown, strict=True):
        seed = min(int(e["seed"]) for e in run.events)
        points: dict[str, set[tuple[int, int]]] = {}
        for ev in run.events:
            if int(ev["seed"]) == seed:
                points.setdefault(ev["kind"], set()).add((int(ev["round"]), int(ev["client"])))
        for kind, pts in sorted(points.items()):
            marker, color = _EVENT_STYLE.get(kind, ("o", "tab:blue"))
            xy = np.array(sorted(pts))
            ax.scatter(xy[:, 0], xy[:, 1], marker=marker, color=color, s=22, label=kind)
        title = "events, all algorithms" + (f" (seed {seed})" if len(run.seeds) > 1 else "")
        ax.set(
            title=title if len(runs) == 1 else f"{run.name}: {title}",
            xlabel="round",
            ylabel="client",
        )
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return fig


def diagnostics(items: list[Entry]) -> Figure | None:
    """Each quantity an algorithm reports in ``diagnostics.csv``, per round (mean over seeds)."""
    names = sorted({k[2] for e in items for k in e.run.diagnostics if k[0] == e.label})
    if not names:
        return None
    fig, axes = _grid(len(names), 3.0)
    for ax, name in zip(axes.flat, names, strict=False):
        for e in items:
            series = [
                e.run.diagnostics[(e.label, s, name)]
                for s in e.run.seeds
                if (e.label, s, name) in e.run.diagnostics
            ]
            if not series:
                continue
            rounds = np.unique(np.concatenate([s.rounds for s in series]))
            values = np.full((len(series), len(rounds)), np.nan)
            for i, s in enumerate(series):
                values[i, np.searchsorted(rounds, s.rounds)] = s.values
            with np.errstate(all="ignore"):
                ax.plot(
                    rounds,
                    np.nanmean(values, 0),
                    color=e.color,
                    label=e.name,
                    lw=1.4,
                    marker="." if len(rounds) < 40 else None,
                )
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    _legend(fig, axes)
    return fig


def select_k(items: list[Entry]) -> Figure | None:
    """The criterion against K of each ``n_clusters: auto`` job (``select_k.csv``), one line
    per seed; a ring marks the chosen K."""
    rows = [(e, r) for e in items for r in e.run.select_k if r["algorithm"] == e.label]
    if not rows:
        return None
    fig, ax = _subplots(figsize=(5.5, 3.4))
    jobs: dict[tuple[str, str], tuple[Entry, list[dict[str, str]]]] = {}
    for e, r in rows:
        jobs.setdefault((e.name, r["seed"]), (e, []))[1].append(r)
    for (_, seed), (e, job) in jobs.items():
        k = np.array([int(r["k"]) for r in job])
        v = np.array([float(r["value"]) for r in job])
        ax.plot(k, v, color=e.color, marker=".", lw=1.2, label=f"{e.name} seed {seed}")
        chosen = np.array([r["chosen"] == "1" for r in job])
        ax.plot(k[chosen], v[chosen], "o", mfc="none", ms=10, color=e.color)
    ax.set_xlabel("number of clusters K")
    ax.set_ylabel(rows[0][1]["criterion"])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig
