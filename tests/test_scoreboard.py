"""docs/reproduction.md's scoreboard (issue 24): its commands name runnable cells whose
presets load and whose algorithm entries validate, and its links reach sections of the
page. Nothing is trained here; the cells themselves run in benchmarks/reproduce.py."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from benchmarks.reproduce import CELLS, EXPERIMENTS, first_round, reached
from fedcluster.algorithms.base import check_algorithms
from fedcluster.config import resolve_config

DOC = Path(__file__).resolve().parents[1] / "docs" / "reproduction.md"


def _prose(text: str) -> str:
    """The page without its fenced code blocks (``#`` there is a shell comment)."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def _scoreboard() -> str:
    text = _prose(DOC.read_text())
    start = text.index("## Scoreboard")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_scoreboard_names_reproduce_experiments_that_exist() -> None:
    names = set(re.findall(r"python -m benchmarks\.reproduce ([\w-]+)", DOC.read_text()))
    assert names & set(CELLS), "the scoreboard names no cell"
    unknown = names - set(CELLS) - set(EXPERIMENTS) - {"summarize"}
    assert not unknown, f"docs/reproduction.md runs unknown experiments {sorted(unknown)}"


@pytest.mark.parametrize("name", sorted(CELLS))
def test_every_cell_resolves_to_a_valid_config(name: str) -> None:
    cell = CELLS[name]
    config = resolve_config(None, cell.preset, list(cell.sets), {"seeds": [0]})
    check_algorithms(config)  # unknown algorithms or parameters (e.g. a misspelt rcc) fail here
    assert config.algorithms


def test_every_preset_the_scoreboard_names_loads() -> None:
    presets = set(re.findall(r"--preset ([\w-]+)", _scoreboard()))
    assert presets
    for preset in presets:
        check_algorithms(resolve_config(None, preset, [], {"seeds": [0]}))


def test_scoreboard_links_reach_headings_of_the_page() -> None:
    headings = {
        _slug(line.lstrip("#"))
        for line in _prose(DOC.read_text()).splitlines()
        if line.startswith("#")
    }
    links = re.findall(r"\]\(#([^)]+)\)", _scoreboard())
    assert links
    assert not sorted(set(links) - headings)


def test_rounds_to_a_target_count_only_seeds_that_reach_it() -> None:
    rows = [
        {"round": 1, "accuracy": 0.5},
        {"round": 2, "accuracy": math.nan},  # not evaluated
        {"round": 3, "accuracy": 0.81},
        {"round": 4, "accuracy": 0.79},
    ]
    assert first_round(rows, "accuracy", 0.8) == 3.0
    assert math.isnan(first_round(rows, "accuracy", 0.9))
    assert reached([3.0, 5.0, math.nan]) == "4.0 ± 1.0 (2/3)"
    assert reached([math.nan]) == "never (0/1)"
