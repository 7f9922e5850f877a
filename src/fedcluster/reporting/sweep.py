"""The report of a sweep (:mod:`fedcluster.sweeps`): its settings, results and paired tests.

Reads only the sweep directory's ``summary.json``; each setting's run
directory has its own report (linked by path in the settings table).
"""

from __future__ import annotations

import json
from pathlib import Path

from fedcluster.reporting.document import Section
from fedcluster.reporting.writers import write_html, write_markdown
from fedcluster.sweeps import paired_rows, result_rows


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
            "interval from Student's t distribution with n − 1 degrees of freedom.",
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
