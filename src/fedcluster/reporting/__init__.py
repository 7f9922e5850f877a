"""The run report: reads run directories, builds the document's sections and
figures and writes HTML/Markdown. It may import ``experiment`` and every layer below it,
never ``flower`` or the entry points.
"""

from __future__ import annotations

from pathlib import Path

from fedcluster.errors import FedclusterError


def write_report(runs: list[str | Path], out: str | Path | None = None) -> Path:
    """Write ``report.html`` and ``report.md`` (+ ``plots/``) for ``runs``; return the HTML path.

    ``out`` defaults to the run directory for one run; several runs need it.
    """
    from fedcluster.reporting.document import build_sections
    from fedcluster.reporting.rundata import load_run, readable
    from fedcluster.reporting.writers import write_html, write_markdown

    if not runs:
        raise FedclusterError("report: give at least one run directory")
    if out is None:
        if len(runs) > 1:
            raise FedclusterError("report: several runs need --out DIR for the comparison report")
        out = runs[0]
    data = [load_run(r) for r in runs]
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FedclusterError(f"report: --out {out} is an existing file, not a directory")
    out.mkdir(parents=True, exist_ok=True)
    with readable(", ".join(map(str, runs))):
        sections = build_sections(data)
    if len(data) == 1:
        title = f"fedcluster report: {data[0].name}"
        subtitle = f"Run directory {data[0].path}; seeds {', '.join(map(str, data[0].seeds))}."
    else:
        title = "fedcluster comparison: " + ", ".join(d.name for d in data)
        subtitle = "Run directories: " + ", ".join(str(d.path) for d in data) + "."
    write_markdown(out / "report.md", title, subtitle, sections)
    write_html(out / "report.html", title, subtitle, sections)
    return out / "report.html"
