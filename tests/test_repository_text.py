"""The repository speaks of the product: no work diary in code, tests or docs.

Code, tests, benchmarks and docs describe what the code does now and cite papers
by title, section and equation; the history of how it got there belongs in
CHANGELOG.md alone. This test fails on a tracker's issue number, a work
session's number (or a folder named after one: s, then its two digits) or a reference to the
numbered principles of design notes that are not in the repository, naming the
file and line. Its own examples are assembled from parts, so that a plain grep
of the repository for those phrases finds nothing, this file included.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ["src", "tests", "benchmarks", "docs", "README.md"]
HISTORY = re.compile(
    r"\bissues?[ _-]?#?\d"  # a tracker's issue number (also in a file name)
    r"|\bsessions? #?\d"  # a work session's number
    r"|\bs1\d\b"  # a folder or file named after a session
    r"|\bdesign[ ]principle",  # design notes outside the repository
    re.IGNORECASE,
)


def _files(root: Path, names: list[str]) -> list[Path]:
    """The files under ``root``'s entries ``names`` (a file or a folder), caches aside."""
    files = []
    for name in names:
        path = root / name
        found = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        files.extend(p for p in found if "__pycache__" not in p.parts)
    return files


def history_references(root: Path, files: list[Path]) -> list[str]:
    """``file:line: text`` of every line (or file name) that narrates history."""
    found = []
    for path in files:
        where = path.relative_to(root)
        if HISTORY.search(str(where)):
            found.append(f"{where}: the file's name")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # binary data
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{where}:{number}: {line.strip()[:100]}")
    return found


ISSUE, SESSION, DESIGN = "issue", "session", "DESIGN"


def test_history_references_are_found_by_file_and_line(tmp_path):
    (tmp_path / "notes.py").write_text(
        f"ok = 1\n# fixed in {ISSUE} 21\nx = 2  # see {ISSUE.title()} #7\n"
        f"# {SESSION}s 11-13 measured this\n# ({DESIGN} principle 4)\n"
        "# cflgt-s1 is a preset, s1x a name, 'issues' alone a word\n"
    )
    folder = tmp_path / "bench" / f"s{13}"
    folder.mkdir(parents=True)
    (folder / "table.md").write_text("clean\n")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\xff\xfe " + f"{ISSUE} 1".encode())
    assert history_references(tmp_path, _files(tmp_path, ["bench", "notes.py", "image.png"])) == [
        f"bench/s{13}/table.md: the file's name",
        f"notes.py:2: # fixed in {ISSUE} 21",
        f"notes.py:3: x = 2  # see {ISSUE.title()} #7",
        f"notes.py:4: # {SESSION}s 11-13 measured this",
        f"notes.py:5: # ({DESIGN} principle 4)",
    ]


def test_code_tests_and_docs_narrate_no_history():
    files = _files(ROOT, SCANNED)
    found = history_references(ROOT, files)
    assert not found, "history belongs in CHANGELOG.md:\n" + "\n".join(found)
