"""Sweeps over any config field: the same table from the CLI and from Python, its
confidence intervals and paired tests against scipy on the per-seed numbers, random
search draws, and one-line errors."""

from __future__ import annotations

import csv
import json
import math
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from scipy import stats

import fedcluster
from fedcluster.cli import build_parser, main
from fedcluster.errors import ConfigError
from fedcluster.stats import WILCOXON_MIN_PAIRS, mean_ci, paired_test
from fedcluster.sweeps import axes_of, collect, config_for, settings_of
from tests.helpers import digits_config


def _tiny(seeds: int = 3) -> dict:
    config = digits_config("tiny", rounds=2)
    config["seeds"] = list(range(seeds))
    return config


def _per_seed(run: Path) -> dict[str, list[float]]:
    """Final accuracy of each algorithm, in seed order, read from a run's summary.json."""
    out: dict[str, dict[int, float]] = {}
    for job in json.loads((run / "summary.json").read_text())["jobs"]:
        out.setdefault(job["algorithm"], {})[job["seed"]] = job["final_accuracy"]
    return {a: [v[s] for s in sorted(v)] for a, v in out.items()}


def test_a_sweep_of_train_lr_gives_the_same_table_from_the_cli_and_python(tmp_path, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(_tiny()))
    cli_out = tmp_path / "cli"
    args = ["compare", str(path), "--algorithms", "fedavg,fedprox", "--seeds", "3"]
    args += ["--sweep", "train.lr=0.05,0.2", "--quiet", "--out", str(cli_out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    config = {**_tiny(), "algorithms": [{"name": "fedavg"}, {"name": "fedprox"}]}
    result = fedcluster.sweep(config, {"train.lr": [0.05, 0.2]}, out=tmp_path / "py", report=False)
    from_cli = fedcluster.SweepResult.load(cli_out)
    assert from_cli.results == result.results and from_cli.paired == result.paired
    assert result.table() in printed
    assert [r["label"] for r in result.results] == ["train.lr=0.05"] * 2 + ["train.lr=0.2"] * 2
    # each setting is its own run, trained with its own learning rate
    for s in result.settings:
        saved = yaml.safe_load((result.path / s["run"] / "config.yaml").read_text())
        assert saved["train"]["lr"] == s["values"]["train.lr"]
        per_seed = _per_seed(result.path / s["run"])
        rows = [r for r in result.results if r["setting"] == s["index"]]
        for row in rows:
            x = np.array(per_seed[row["algorithm"]])
            low, high = stats.t.interval(0.95, len(x) - 1, loc=x.mean(), scale=stats.sem(x))
            assert row["per_seed"] == list(x) and row["n"] == 3
            assert row["mean"] == pytest.approx(x.mean(), rel=1e-12)
            assert (row["ci_low"], row["ci_high"]) == pytest.approx((low, high), rel=1e-9)
        (pair,) = [p for p in result.paired if p["setting"] == s["index"]]
        d = np.array(per_seed["fedavg"]) - np.array(per_seed["fedprox"])
        t = d.mean() / (d.std(ddof=1) / math.sqrt(len(d)))
        assert pair["difference"] == pytest.approx(d.mean(), rel=1e-9, abs=1e-15)
        assert pair["t_p"] == pytest.approx(2 * stats.t.sf(abs(t), len(d) - 1), rel=1e-9)
    report = (cli_out / "report.md").read_text()
    assert "train.lr=0.2" in report and "fedavg − fedprox" in report
    assert (cli_out / "plots" / "results.png").stat().st_size > 0
    assert all((cli_out / s["run"] / "report.html").exists() for s in from_cli.settings)


def test_mean_ci_is_the_student_t_interval():
    values = [0.61, 0.64, 0.58, 0.66]
    ci = mean_ci(values)
    m = sum(values) / 4
    s = math.sqrt(sum((v - m) ** 2 for v in values) / 3)
    half = stats.t.ppf(0.975, 3) * s / 2  # sqrt(4) = 2
    assert (ci.mean, ci.low, ci.high) == pytest.approx((m, m - half, m + half), rel=1e-12)
    one = mean_ci([0.5])
    assert one.mean == 0.5 and math.isnan(one.low) and math.isnan(one.high)


def test_paired_test_uses_the_differences_and_wilcoxon_only_where_it_can_reject():
    a = [0.70, 0.72, 0.69]
    b = [0.68, 0.71, 0.66]
    test = paired_test("a", a, "b", b)
    d = np.subtract(a, b)
    assert test.difference.mean == pytest.approx(d.mean(), rel=1e-12)
    assert test.t_p == pytest.approx(stats.ttest_1samp(d, 0).pvalue, rel=1e-9)
    assert test.wilcoxon_p is None  # 3 pairs: Wilcoxon's smallest p is 2/2^3 = 0.25
    assert 2 / 2**WILCOXON_MIN_PAIRS < 0.05 < 2 / 2 ** (WILCOXON_MIN_PAIRS - 1)
    six = paired_test("a", [1, 2, 3, 4, 5, 6], "b", [0, 0, 0, 0, 0, 0])
    assert six.wilcoxon_p == pytest.approx(2 / 2**6)
    same = paired_test("a", [0.5, 0.6], "b", [0.4, 0.5])  # a constant difference
    assert same.t_p == 0.0


def test_a_grid_of_fields_and_an_algorithm_parameter():
    axes = axes_of(
        ["train.lr=0.01,0.1", "data.partition.n_clients=3,4", "algorithms.jgl.lam=0.1,0.5"]
    )
    settings, within = settings_of(axes, None)
    assert settings == [
        {"train.lr": 0.01, "data.partition.n_clients": 3},
        {"train.lr": 0.01, "data.partition.n_clients": 4},
        {"train.lr": 0.1, "data.partition.n_clients": 3},
        {"train.lr": 0.1, "data.partition.n_clients": 4},
    ]
    raw = {**_tiny(), "algorithms": [{"name": "jgl"}]}
    config = config_for(raw, settings[1], within)
    assert config.train.lr == 0.01 and config.data.partition["n_clients"] == 4
    assert [a.label for a in config.algorithms] == ["jgl(lam=0.1)", "jgl(lam=0.5)"]


def test_random_search_draws_the_same_settings_for_the_same_seed():
    axes = axes_of(
        {
            "train.lr": "loguniform(1e-3,1e-1)",
            "train.local_epochs": "int(1,3)",
            "model.options.hidden": [[8], [16]],
        }
    )
    first, within = settings_of(axes, 20, seed=3)
    again, _ = settings_of(axes, 20, seed=3)
    other, _ = settings_of(axes, 20, seed=4)
    assert first == again and first != other and within == []
    assert all(1e-3 <= s["train.lr"] <= 1e-1 for s in first)
    assert {s["train.local_epochs"] for s in first} <= {1, 2, 3}
    assert {tuple(s["model.options.hidden"]) for s in first} <= {(8,), (16,)}
    # loguniform: the draws' logarithms spread over the whole range
    logs = np.log10([s["train.lr"] for s in first])
    assert logs.min() < -2 < logs.max()


@pytest.mark.parametrize(
    ("sweeps", "trials", "message"),
    [
        (["train.lr"], None, "expected FIELD=v1,v2"),
        (["train.lr=loguniform(0,1)"], 4, "positive lower bound"),
        (["train.lr=uniform(0.5,0.1)"], 4, "must be below"),
        (["train.lr=loguniform(1e-3,1e-1)"], None, "needs --trials"),
        (["train.lr=0.1", "train.lr=0.2"], None, "swept twice"),
        (["train.lr=0.1"], 0, "give 1 to 10,000 trials"),
        (["train.lr=0.1"], 10**6, "give 1 to 10,000 trials"),
        (
            [
                "train.lr=" + ",".join(str(i + 1) for i in range(200)),
                "train.batch_size=" + ",".join(str(i + 1) for i in range(200)),
            ],
            None,
            "40,000 settings",
        ),
        ([], 3, "give the fields to draw with --sweep"),
    ],
)
def test_bad_sweeps_are_one_line_errors(sweeps, trials, message):
    with pytest.raises(ConfigError, match=message):
        settings_of(axes_of(sweeps), trials)


def test_bad_input_stops_the_sweep_in_one_line_before_any_run(tmp_path, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(_tiny(1)))
    out = tmp_path / "sweep"
    cases = [
        (["--sweep", "train.lr=0.1,-1"], "train.lr"),
        (["--sweep", "train.lr=0.1,0.2", "--backend", "flower"], "simulator backend only"),
    ]
    for extra, message in cases:
        assert main(["run", str(path), *extra, "--quiet", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
        assert not out.exists()
    (out / "kept").mkdir(parents=True)
    assert main(["run", str(path), "--sweep", "train.lr=0.1", "--out", str(out)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["kept"]
    with pytest.raises(ConfigError, match="sweep metric .acc.: not one of .*final_accuracy"):
        fedcluster.sweep(_tiny(1), {"train.lr": [0.1]}, out=tmp_path / "m", metric="acc")
    assert not (tmp_path / "m").exists()
    with pytest.raises(ConfigError, match="sweep model.options.hidden: the model is given as"):
        fedcluster.sweep(
            _tiny(1), {"model.options.hidden": [[4], [8]]}, model=torch.nn.Linear(64, 10)
        )


def test_a_random_search_over_a_data_field_rebuilds_the_federation_per_setting(tmp_path, capsys):
    config = digits_config(
        "tiny", rounds=1, algorithms=[{"name": "ifca", "params": {"n_clusters": 2}}]
    )
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "search"
    sweeps = ["train.lr=loguniform(0.01,0.3)", "data.partition.n_clients=3,5"]
    args = ["run", str(path), "--seed", "0", "--trials", "3", "--sweep-seed", "1"]
    args += [a for s in sweeps for a in ("--sweep", s)] + ["--quiet", "--no-report"]
    assert main([*args, "--out", str(out)]) == 0
    capsys.readouterr()
    result = fedcluster.SweepResult.load(out)
    drawn, _ = settings_of(axes_of(sweeps), 3, seed=1)
    assert [s["values"] for s in result.settings] == drawn
    assert {s["data.partition.n_clients"] for s in drawn} == {3, 5}
    for s in result.settings:
        with open(out / s["run"] / "clusters.csv") as f:
            clients = {r["client"] for r in csv.DictReader(f)}
        assert len(clients) == s["values"]["data.partition.n_clients"]
    assert [r["n"] for r in result.results] == [1, 1, 1]  # one seed: no interval
    assert all(r["ci_low"] is None for r in result.results)
    data = json.loads((out / "summary.json").read_text())
    assert (data["mode"], data["trials"], data["sweep_seed"]) == ("random", 3, 1)
    assert main(["report", str(out)]) == 0  # a sweep directory's report
    assert "loguniform(0.01,0.3)" in (out / "report.md").read_text()
    assert (out / "plots" / "results.png").stat().st_size > 0


def test_values_with_commas_inside_brackets_are_one_value():
    (axis,) = axes_of(["model.options.hidden=[8,8],[16]"])
    assert axis.values == ([8, 8], [16])
    assert axes_of([axis.text()]) == [axis]


def test_the_commands_of_docs_sweeps_md_parse_into_valid_sweeps():
    text = (Path(__file__).resolve().parents[1] / "docs" / "sweeps.md").read_text()
    (block,) = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    commands = [c for c in block.replace("\\\n", " ").splitlines() if c.startswith("fedcluster")]
    assert len(commands) == 3
    for command in commands:
        args = build_parser().parse_args(shlex.split(command)[1:])
        settings, _ = settings_of(axes_of(args.sweeps), args.trials, args.sweep_seed)
        assert settings and all(len(s) == len(args.sweeps) for s in settings)


def test_a_sweep_of_an_algorithm_parameter_prints_its_intervals_and_paired_tests(tmp_path, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(digits_config("tiny", rounds=1)))
    out = tmp_path / "run"
    args = ["compare", str(path), "--algorithms", "fedprox", "--seeds", "2", "--quiet"]
    args += ["--sweep", "algorithms.fedprox.mu=0.01,0.1", "--no-report", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    per_seed = _per_seed(out)
    assert list(per_seed) == ["fedprox(mu=0.01)", "fedprox(mu=0.1)"]
    for label, values in per_seed.items():
        ci = mean_ci(values)
        assert f"| {label}" in printed and f"[{100 * ci.low:.2f}, {100 * ci.high:.2f}]" in printed
    assert "fedprox(mu=0.01) − fedprox(mu=0.1)" in printed


def test_a_job_without_the_metric_is_left_out_of_its_mean_and_pairs(tmp_path):
    values = {"a": [0.61, 0.64, 0.58], "b": [0.60, None, 0.55]}
    jobs = [
        {"algorithm": a, "seed": s, "final_accuracy": v}
        for a, vs in values.items()
        for s, v in enumerate(vs)
    ]
    (tmp_path / "summary.json").write_text(json.dumps({"name": "x", "jobs": jobs}))
    results, paired = collect([{}], [tmp_path], "final_accuracy")
    assert [r["seeds"] for r in results] == [[0, 1, 2], [0, 2]]
    assert results[1]["mean"] == pytest.approx((0.60 + 0.55) / 2, rel=1e-12)
    (pair,) = paired
    assert pair["n"] == 2
    assert pair["difference"] == pytest.approx(((0.61 - 0.60) + (0.58 - 0.55)) / 2, rel=1e-12)
    json.dumps(paired, allow_nan=False)  # what summary.json holds
