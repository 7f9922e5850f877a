"""Summary tables of a run: per algorithm, mean ± std over seeds."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def _mean_std(values: Sequence[float | None], scale: float = 1.0, digits: int = 1) -> str:
    vals = [v * scale for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return "-"
    if len(vals) == 1:
        return f"{vals[0]:.{digits}f}"
    return f"{np.mean(vals):.{digits}f} ± {np.std(vals):.{digits}f}"


def summary_rows(jobs: list[dict]) -> list[dict[str, str]]:
    """One row per algorithm, aggregating its seeds (input: ``job_summary`` dicts)."""
    by_alg: dict[str, list[dict]] = defaultdict(list)
    for job in jobs:
        by_alg[job["algorithm"]].append(job)
    rows = []
    for alg, runs in by_alg.items():
        rows.append(
            {
                "algorithm": alg,
                "seeds": str(len(runs)),
                "final acc %": _mean_std([r["final_accuracy"] for r in runs], 100),
                "best acc %": _mean_std([r["best_accuracy"] for r in runs], 100),
                "client acc % (mean ± std)": _client_acc(runs),
                "ARI": _mean_std([r.get("final_ari") for r in runs], 1, 2),
                "purity": _purity(runs),
                "rounds to 0.9 purity": _rounds_to_purity(runs),
                "MB up": _mean_std([r["bytes_up"] / 1e6 for r in runs], 1, 1),
                "MB down": _mean_std([r["bytes_down"] / 1e6 for r in runs], 1, 1),
                "time s": _mean_std([r["wall_seconds"] for r in runs], 1, 1),
            }
        )
    return rows


def _purity(runs: list[dict]) -> str:
    """Final purity; where fewer clusters than groups cap it, with the ceiling: ``0.29 (≤ 0.30)``.

    The ceiling (:func:`~fedcluster.clustering.validity.purity_ceiling`) is the
    best purity with the method's final cluster count; where it is below 1 the
    ARI column, which does not penalise merging by design, is the headline.
    Over seeds the printed ceiling is the mean of the same seeds' ceilings (1
    where the cluster count does not cap purity), so it bounds the mean printed
    beside it: each seed's purity is at most its own ceiling.
    """
    scored = [r for r in runs if r["final_purity"] is not None]
    text = _mean_std([r["final_purity"] for r in scored], 1, 2)
    ceilings = [r.get("final_purity_ceiling") or 1.0 for r in scored]
    ceiling = float(np.mean(ceilings)) if ceilings else 1.0
    return text + (f" (≤ {ceiling:.2f})" if ceiling < 1.0 else "")


def _rounds_to_purity(runs: list[dict]) -> str:
    if all(r["final_purity"] is None for r in runs):
        return "-"
    reached = [float(r["rounds_to_purity_0.9"]) for r in runs if r["rounds_to_purity_0.9"]]
    never = len(runs) - len(reached)
    text = _mean_std(reached, 1, 1) if reached else "never"
    return text + (f" ({never} never)" if never and reached else "")


def _client_acc(runs: list[dict]) -> str:
    means = [r["final_accuracy_mean"] for r in runs if r["final_accuracy_mean"] is not None]
    stds = [r["final_accuracy_std"] for r in runs if r["final_accuracy_std"] is not None]
    if not means:
        return "-"
    return f"{100 * np.mean(means):.1f} ± {100 * np.mean(stds):.1f}"


def format_table(rows: list[dict[str, str]]) -> str:
    """A plain-text table (also valid Markdown)."""
    if not rows:
        return "(no results)"
    cols = list(rows[0])
    width = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    line = "| " + " | ".join(c.ljust(width[c]) for c in cols) + " |"
    sep = "|" + "|".join("-" * (width[c] + 2) for c in cols) + "|"
    body = ["| " + " | ".join(r[c].ljust(width[c]) for c in cols) + " |" for r in rows]
    return "\n".join([line, sep, *body])


def print_summary(out: Path) -> None:
    """Print a finished run's summary table and where its metrics and clusters are."""
    print()
    print((out / "summary.md").read_text(), end="")
    print(
        f"\nmetrics: {out / 'metrics.csv'}   clusters: {out / 'clusters.csv'}   "
        f"clients: {out / 'clients.csv'}"
    )
