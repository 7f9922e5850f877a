"""docs/reproduction.md's scoreboard: its commands name runnable cells whose
presets load and whose algorithm entries validate, and its links reach sections of the
page. Nothing is trained here; the cells themselves run in src/fedcluster/reproduce.py."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from fedcluster.algorithms.base import check_algorithms
from fedcluster.config.schema import resolve_config
from fedcluster.reproduce import (
    CELLS,
    EXPERIMENTS,
    PAPER_ORDER,
    first_round,
    load_jobs,
    paper_order_lines,
    reached,
    scoreboard_tables,
)

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
    names = set(re.findall(r"python -m fedcluster\.reproduce ([\w-]+)", DOC.read_text()))
    assert names & set(CELLS), "the scoreboard names no cell"
    unknown = names - set(CELLS) - set(EXPERIMENTS) - {"summarize", "scoreboard"}
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


def _write_job(folder: Path, name: str, algorithm: str, accuracies: list[float]) -> None:
    """A job's metrics.csv as benchmarks/gpu/scoreboard_cpu.sh leaves it (maybe cut short)."""
    run = folder / "runs" / name / f"cflgt-fmnist-s2-{algorithm}"
    run.mkdir(parents=True)
    head = "round,algorithm,seed,accuracy,accuracy_mean,accuracy_std,purity,ari,n_clusters,"
    lines = [head + "epsilon,client_seconds,server_seconds"]
    for rnd, acc in enumerate(accuracies, 1):
        lines.append(f"{rnd},{algorithm},0,{acc},{acc},0.1,,,,,1.0,0.5")
    (run / "metrics.csv").write_text("\n".join(lines) + "\n")


def test_scoreboard_tables_merge_jobs_and_flag_cut_ones(tmp_path: Path) -> None:
    (tmp_path / "jobs.txt").write_text(
        "c8-cflgt-s0 cflgt-fmnist-s2 0 cflgt 3\nc8-fedavg-s0 cflgt-fmnist-s2 0 fedavg 3\n"
        "c8-fesem-s0 cflgt-fmnist-s2 0 fesem 3\n"  # never started: no run directory
    )
    _write_job(tmp_path, "c8-cflgt-s0", "cflgt", [0.5, 0.7, 0.9])
    _write_job(tmp_path, "c8-fedavg-s0", "fedavg", [0.4, 0.6])  # cut after round 2
    rows = {r["algorithm"]: r for r in scoreboard_tables(tmp_path)["cflgt-fmnist-s2"]}
    assert set(rows) == {"cflgt", "fedavg"}
    assert (rows["cflgt"]["rounds"], rows["fedavg"]["rounds"]) == ("3/3", "2/3")
    assert rows["cflgt"]["last-20 acc %"] == "70.0 ± 0.0"  # (50 + 70 + 90) / 3
    assert rows["fedavg"]["final acc %"] == "60.0 ± 0.0"
    common = {r["algorithm"]: r for r in scoreboard_tables(tmp_path, upto=2)["cflgt-fmnist-s2"]}
    assert common["cflgt"]["final acc %"] == "70.0 ± 0.0"
    assert common["cflgt"]["rounds"] == "2/3"
    (line,) = paper_order_lines("cflgt-fmnist-s2", scoreboard_tables(tmp_path)["cflgt-fmnist-s2"])
    assert line.startswith("last-20 acc %: fedavg 50.0 ± 0.0 (1; 2/3) / fedavg-ft - / ")
    assert line.endswith(" / cflgt 70.0 ± 0.0 (1; 3/3)")


@pytest.mark.parametrize("name", sorted(PAPER_ORDER))
def test_paper_order_names_the_cells_algorithms(name: str) -> None:
    cell = CELLS[name]
    config = resolve_config(None, cell.preset, list(cell.sets), {"seeds": [0]})
    assert set(PAPER_ORDER[name][1]) == {a.display_name() for a in config.algorithms}


def test_cifar10_scenario3_preset_runs_each_flhc_alone() -> None:
    """The scoreboard runs CFLGT's CIFAR-10 scenario 3 one method a process
    (``--algorithms flhc``): Table I's FL+HC (20 clusters) is labelled, so its label
    selects it alone, not Table II's 10- and 30-cluster entries that share its name."""
    for label, k in (("flhc", 20), ("flhc-10", 10), ("flhc-30", 30)):
        config = resolve_config(None, "cflgt-s3-cifar10", [], {}, algorithms=[label])
        (entry,) = config.algorithms
        assert (entry.label, entry.name, entry.params["n_clusters"]) == (label, "flhc", k)


def _metrics_file(folder: Path, rows: list[tuple[int, str, int, float]]) -> str:
    folder.mkdir()
    lines = ["round,algorithm,seed,accuracy"] + [f"{r},{a},{s},{acc}" for r, a, s, acc in rows]
    (folder / "metrics.csv").write_text("\n".join(lines) + "\n")
    return str(folder)


def test_summarize_refuses_a_job_found_in_two_runs(tmp_path: Path) -> None:
    """Two runs of one preset family each hold (fedavg, seed 0), e.g. CIFAR-10 scenarios
    1 and 3: pooled, their rows made one wrong last-20 score; now that is refused, naming
    both folders, while different seeds or DIR:SEEDS still merge."""
    s1 = _metrics_file(tmp_path / "s1", [(1, "fedavg", 0, 0.5), (2, "fedavg", 0, 0.6)])
    s3 = _metrics_file(tmp_path / "s3", [(1, "fedavg", 0, 0.3), (2, "fedavg", 0, 0.4)])
    with pytest.raises(ValueError, match="fedavg seed 0 is in both .*s1 and .*s3"):
        load_jobs([s1, s3])
    other = _metrics_file(tmp_path / "seed1", [(1, "fedavg", 1, 0.7), (2, "fedavg", 1, 0.8)])
    jobs = load_jobs([s1, other])
    assert {(j["algorithm"], j["seed"], len(j["rows"])) for j in jobs} == {
        ("fedavg", 0, 2),
        ("fedavg", 1, 2),
    }
    (job,) = load_jobs([s1, f"{s3}:1"])  # s3's seed 0 left out
    assert [r["accuracy"] for r in job["rows"]] == [0.5, 0.6]
