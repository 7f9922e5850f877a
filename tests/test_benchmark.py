"""fedcluster benchmark: a tiny suite's leaderboard against independent computations from its
run directories (summary.json, clients.csv) with scipy.stats."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from fedcluster.algorithms import ALGORITHMS
from fedcluster.benchmark import Suite, list_suites, load_suite, run_benchmark
from fedcluster.cli import main
from fedcluster.errors import ConfigError

SUITE = {
    "name": "tiny",
    "config": {
        "seeds": [0, 1],
        "rounds": 3,
        "data": {
            "dataset": "mnist5k",
            "partition": {"name": "iid", "n_clients": 10, "samples_per_client": 60},
        },
        "model": {"name": "mlp", "options": {"hidden": [16]}},
        "train": {"lr": 0.1, "batch_size": 20},
    },
    "methods": ["fedavg", "ifca", "fesem"],
    "params": {"ifca": {"n_clusters": 2}, "fesem": {"n_clusters": 2}},
    "scenarios": [
        {
            "name": "concept",
            "set": {"data.shift": {"kind": "concept_y_given_x", "groups": 2}},
            "unseen": 2,
        },
        {"name": "label", "set": {"data.shift": {"kind": "label", "groups": 2}}},
    ],
}


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("bench")
    result = run_benchmark(Suite.model_validate(SUITE), out)
    return out, result.rows


def _final_clients(run: Path) -> pd.DataFrame:
    clients = pd.read_csv(run / "clients.csv")
    last = clients.groupby(["algorithm", "seed"])["round"].transform("max")
    return clients[clients["round"] == last]


def test_every_scenario_and_method_has_a_row(finished) -> None:
    out, rows = finished
    assert [(r["scenario"], r["method"]) for r in rows] == [
        (s, m) for s in ("concept", "label") for m in ("fedavg", "ifca", "fesem")
    ]
    assert json.loads((out / "leaderboard.json").read_text())["rows"] == rows
    text = (out / "leaderboard.md").read_text()
    assert "| concept" in text and "(best)" in text and (out / "report.html").is_file()
    assert "data:image/png;base64," in (out / "report.html").read_text()
    assert (out / "plots" / "leaderboard.png").is_file()


def test_means_intervals_and_paired_tests_follow_scipy(finished) -> None:
    out, rows = finished
    for i, scenario in enumerate(("concept", "label")):
        jobs = json.loads((out / f"{i:02d}-{scenario}" / "summary.json").read_text())["jobs"]
        acc = {
            m: [j["final_accuracy"] for j in sorted(jobs, key=lambda j: j["seed"])
                if j["algorithm"] == m]
            for m in ("fedavg", "ifca", "fesem")
        }  # fmt: skip
        best = max(acc, key=lambda m: np.mean(acc[m]))
        for r in (r for r in rows if r["scenario"] == scenario):
            values = acc[r["method"]]
            assert r["accuracy"] == values and r["best"] == (r["method"] == best)
            low, high = stats.t.interval(
                0.95, len(values) - 1, loc=np.mean(values), scale=stats.sem(values)
            )
            assert r["mean"] == pytest.approx(np.mean(values), rel=1e-12)
            if math.isfinite(low):
                assert (r["ci_low"], r["ci_high"]) == pytest.approx((low, high), rel=1e-9)
            if r["method"] == best:
                assert r["p_vs_best"] is None
            else:
                p = stats.ttest_rel(values, acc[best]).pvalue
                assert r["p_vs_best"] == (None if np.isnan(p) else pytest.approx(p, rel=1e-9))
            mb = np.mean(
                [(j["bytes_up"] + j["bytes_down"]) / 1e6 for j in jobs
                 if j["algorithm"] == r["method"]]
            )  # fmt: skip
            assert r["megabytes"] == pytest.approx(mb, rel=1e-12)


def test_worst_tenth_is_read_from_clients_csv(finished) -> None:
    out, rows = finished
    for i, scenario in enumerate(("concept", "label")):
        final = _final_clients(out / f"{i:02d}-{scenario}")
        for r in (r for r in rows if r["scenario"] == scenario):
            worst = []
            for seed in (0, 1):
                job = final[(final["algorithm"] == r["method"]) & (final["seed"] == seed)]
                acc = np.sort(job.loc[job["samples"] > 0, "accuracy"].to_numpy())
                worst.append(acc[: max(1, math.ceil(0.1 * len(acc)))].mean())
            assert r["worst"] == pytest.approx(np.mean(worst), rel=1e-12)


def test_unseen_clients_are_never_trained_and_scored_apart(finished) -> None:
    out, rows = finished
    final = _final_clients(out / "00-concept")
    assert set(final["client"]) == set(range(8))  # clients 8 and 9 never joined
    for r in rows:
        if r["scenario"] == "concept":
            assert 0.0 <= r["unseen"] <= 1.0
        else:
            assert r["unseen"] is None


def test_a_finished_benchmark_is_read_back_not_run_again(finished) -> None:
    out, rows = finished
    metrics = (out / "01-label" / "metrics.csv").read_bytes()
    again = run_benchmark(Suite.model_validate(SUITE), out)
    assert again.rows == rows
    assert (out / "01-label" / "metrics.csv").read_bytes() == metrics


def test_all_methods_means_every_registered_algorithm() -> None:
    suite = Suite.model_validate({**SUITE, "methods": "all", "exclude": ["local"]})
    assert suite.method_names() == [n for n in sorted(ALGORITHMS) if n != "local"]
    config = suite.config_for(suite.scenarios[0])
    assert [a.name for a in config.algorithms] == suite.method_names()
    assert config.scenario.joins.rounds == [4, 4]
    # a preset's sections are completed, not replaced, by the suite's config
    on_preset = Suite.model_validate(
        {**SUITE, "preset": "rotation", "config": {"train": {"lr": 0.2}}}
    )
    merged = on_preset.config_for(on_preset.scenarios[1])
    assert merged.train.lr == 0.2 and merged.train.batch_size == 32  # the preset's
    assert merged.data.dataset == "mnist" and merged.data.shift is not None


def test_bad_suites_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ConfigError, match="unknown method 'nosuch'"):
        Suite.model_validate({**SUITE, "methods": ["nosuch"]}).method_names()
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nscenarios: []\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_suite(bad)
    twice = tmp_path / "twice.yaml"
    twice.write_text(json.dumps({**SUITE, "scenarios": [SUITE["scenarios"][1]] * 2}))
    with pytest.raises(ConfigError, match="two scenarios are named 'label'"):
        load_suite(twice)
    with pytest.raises(ConfigError, match="unknown suite"):
        load_suite("no-such-suite")
    assert main(["benchmark", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_built_in_suites_validate_and_are_listed(capsys: pytest.CaptureFixture) -> None:
    assert list_suites()
    assert main(["list", "suites"]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name}  " in listed for name in list_suites())
    for name in list_suites():
        suite = load_suite(name)
        for scenario in suite.scenarios:
            suite.config_for(scenario)


def test_the_command_reads_a_finished_benchmark_back(
    finished, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out, rows = finished
    suite = tmp_path / "tiny.yaml"
    suite.write_text(json.dumps(SUITE))  # JSON is YAML
    assert main(["benchmark", str(suite), "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "ifca" in printed and "(best)" in printed and "report:" in printed
    assert json.loads((out / "leaderboard.json").read_text())["rows"] == rows


def test_a_changed_suite_is_not_resumed_into_the_old_directory(finished) -> None:
    out, _ = finished
    changed = {**SUITE, "config": {**SUITE["config"], "rounds": 4}}
    with pytest.raises(ConfigError, match="another 'rounds'.*new --out"):
        run_benchmark(Suite.model_validate(changed), out)


def test_a_warning_is_written_to_events_csv_once(finished) -> None:
    from fedcluster.benchmark import _record_warnings

    out, _ = finished
    run = out / "01-label"
    for _ in range(2):  # a benchmark read back again finds the warning there already
        _record_warnings(run, 3, [("ifca", 1, "the rule 'entropy' gave all, of 2")])
    events = pd.read_csv(run / "events.csv")
    mine = events[events["detail"] == "the rule 'entropy' gave all, of 2"]
    assert len(mine) == 1 and mine[
        ["algorithm", "seed", "round", "client", "kind"]
    ].values.tolist() == [["ifca", 1, 3, -1, "warning"]]
