"""The report's two formats: one self-contained HTML page and Markdown with PNGs beside it.

``report.html`` embeds every figure as a base64 ``data:`` URL and its CSS
inline, so it opens offline and can be mailed as one file; ``report.md``
links the same figures as ``plots/<section>.png``.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

from fedcluster.experiment.safefiles import write_atomic
from fedcluster.experiment.summary import format_table
from fedcluster.reporting.document import Section

_CSS = """
body { font-family: system-ui, sans-serif; max-width: 1200px; margin: 2em auto; padding: 0 1em;
       color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0 1em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
img { max-width: 100%; }
pre { background: #f6f6f6; padding: 0.8em; font-size: 0.8em; overflow-x: auto; }
nav a { margin-right: 1em; } p.note { color: #555; }
"""


def _html_table(rows: list[dict[str, str]]) -> str:
    if not rows:
        return "<p>(no results)</p>"
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r.values()) + "</tr>"
        for r in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def write_html(path: Path, title: str, subtitle: str, sections: list[Section]) -> None:
    """One page: a table of contents, then each section with its figure, tables and code."""
    nav = "".join(f'<a href="#{s.key}">{html.escape(s.title)}</a>' for s in sections)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1><p class='note'>{html.escape(subtitle)}</p>",
        f"<nav>{nav}</nav>",
    ]
    for s in sections:
        parts.append(f'<section id="{s.key}"><h2>{html.escape(s.title)}</h2>')
        if s.text:
            parts.append(f"<p class='note'>{html.escape(s.text)}</p>")
        if s.image is not None:
            data = base64.b64encode(s.image).decode("ascii")
            parts.append(f'<img alt="{html.escape(s.title)}" src="data:image/png;base64,{data}">')
        for caption, rows in s.tables:
            if caption:
                parts.append(f"<h3>{html.escape(caption)}</h3>")
            parts.append(_html_table(rows))
        if s.code is not None:
            parts.append(f"<pre>{html.escape(s.code)}</pre>")
        parts.append("</section>")
    parts.append("</body></html>\n")
    write_atomic(path, "\n".join(parts).encode())


def write_markdown(path: Path, title: str, subtitle: str, sections: list[Section]) -> None:
    """``report.md`` and its figures as ``plots/<key>.png`` beside it."""
    plots = path.parent / "plots"
    lines = [f"# {title}", "", subtitle, ""]
    for s in sections:
        lines += [f"## {s.title}", ""]
        if s.text:
            lines += [s.text, ""]
        if s.image is not None:
            plots.mkdir(parents=True, exist_ok=True)
            write_atomic(plots / f"{s.key}.png", s.image)
            lines += [f"![{s.title}](plots/{s.key}.png)", ""]
        for caption, rows in s.tables:
            if caption:
                lines += [f"### {caption}", ""]
            lines += [format_table(rows), ""]
        if s.code is not None:
            lines += ["```yaml", s.code.rstrip("\n"), "```", ""]
    write_atomic(path, "\n".join(lines).encode())
