"""The report of a sweep (:mod:`fedcluster.sweeps`): its settings, results and paired tests.

Reads only the sweep directory's ``summary.json``; each setting's run
directory has its own report (linked by path in the settings table).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedcluster.reporting.document import Section
from fedcluster.reporting.figures import _subplots, png
from fedcluster.reporting.writers import write_html, write_markdown


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.2f}"


def _p(x: float | None) -> str:
    return "–" if x is None else f"{x:.3g}"


def result_rows(results: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The results as text rows (metric in %, the 95 % interval in brackets)."""
    return [
        {
            "setting": r["label"] or "(base)",
            "algorithm": r["algorithm"],
            "seeds": str(r["n"]),
            "mean %": _pct(r["mean"]),
            "95% CI %": f"[{_pct(r['ci_low'])}, {_pct(r['ci_high'])}]",
        }
        for r in results
    ]


def paired_rows(paired: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The paired tests as text rows (difference a − b in points, its interval, p-values)."""
    return [
        {
            "setting": r["label"] or "(base)",
            "a − b": f"{r['a']} − {r['b']}",
            "seeds": str(r["n"]),
            "difference %": _pct(r["difference"]),
            "95% CI %": f"[{_pct(r['ci_low'])}, {_pct(r['ci_high'])}]",
            "paired t p": _p(r["t_p"]),
            "Wilcoxon p": _p(r["wilcoxon_p"]),
        }
        for r in paired
    ]


def _numeric_axis(data: dict[str, Any]) -> str | None:
    """The swept field when there is one and its values are numbers, else None."""
    fields = {f for s in data["settings"] for f in s["values"]}
    if len(fields) != 1:
        return None
    (name,) = fields
    values = [s["values"][name] for s in data["settings"]]
    numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    return name if numeric else None


def results_figure(data: dict[str, Any]) -> bytes | None:
    """Mean and 95% interval of each algorithm per setting: against the swept value where
    one numeric field is swept (log scale when it spans a factor of 10 or more), else
    against the settings in order. None with a single setting."""
    results = data["results"]
    if len(data["settings"]) < 2 or not results:
        return None
    field = _numeric_axis(data)
    fig, ax = _subplots(figsize=(7, 4), constrained_layout=True)
    line = "-" if field else "none"  # settings in order are not a scale to draw lines on
    x_of = {s["index"]: (s["values"][field] if field else s["index"]) for s in data["settings"]}
    for algorithm in dict.fromkeys(r["algorithm"] for r in results):
        rows = sorted(
            (r for r in results if r["algorithm"] == algorithm and r["mean"] is not None),
            key=lambda r: x_of[r["setting"]],
        )
        x = [x_of[r["setting"]] for r in rows]
        mean = [100 * r["mean"] for r in rows]
        low = [0.0 if r["ci_low"] is None else 100 * (r["mean"] - r["ci_low"]) for r in rows]
        high = [0.0 if r["ci_high"] is None else 100 * (r["ci_high"] - r["mean"]) for r in rows]
        ax.errorbar(x, mean, yerr=[low, high], marker="o", capsize=3, label=algorithm, ls=line)
    if field:
        xs = list(x_of.values())
        if min(xs) > 0 and max(xs) / min(xs) >= 10:
            ax.set_xscale("log")
        ax.set_xlabel(field)
    else:
        labels = {s["index"]: s["label"] for s in data["settings"]}
        ax.set_xticks(list(labels), [labels[i] for i in labels], rotation=30, ha="right")
        ax.set_xlabel("setting")
    ax.set_ylabel(f"{data['metric']} %")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return png(fig)


def write_sweep_report(path: str | Path) -> Path:
    """Write ``report.html`` and ``report.md`` of the sweep directory ``path``; return the HTML."""
    path = Path(path)
    data = json.loads((path / "summary.json").read_text())
    settings = [
        {"#": str(s["index"]), "setting": s["label"] or "(base)", "run directory": s["run"]}
        for s in data["settings"]
    ]
    sections = [
        Section(
            "results",
            "Results per setting",
            f"{data['metric']} of each algorithm: the mean over seeds and its 95% confidence "
            "interval from Student's t distribution with n − 1 degrees of freedom (the "
            "figure's error bars; none with one seed).",
            image=results_figure(data),
            tables=[("", result_rows(data["results"]))],
        ),
        Section(
            "settings",
            "Settings",
            "One run directory per setting, each with its own report.",
            tables=[("", settings)],
        ),
    ]
    if data["paired"]:
        sections.insert(
            1,
            Section(
                "paired",
                "Methods compared on the same seeds",
                "Difference a − b of the per-seed results, its 95% t interval and the paired "
                "t-test's p-value. The seeds give both methods the same partition and "
                "initialisation, so the results are paired; the t-test is used because with "
                "fewer than 6 seeds the Wilcoxon signed-rank test cannot reach p < 0.05 "
                "(its p-value is shown from 6 seeds on).",
                tables=[("", paired_rows(data["paired"]))],
            ),
        )
    mode = f"random search, {data['trials']} trials (seed {data['sweep_seed']})"
    subtitle = (
        f"Sweep directory {path}; {mode if data['mode'] == 'random' else 'grid'} over "
        + "; ".join(data["axes"])
        + "."
    )
    title = f"fedcluster sweep: {data['name']}"
    write_markdown(path / "report.md", title, subtitle, sections)
    write_html(path / "report.html", title, subtitle, sections)
    return path / "report.html"
