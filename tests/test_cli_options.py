"""The CLI explains itself and only suggests what exists: list/show, --algorithms, --set by
algorithm name, --sweep, run directory names, and every --flag named in an error message."""

from __future__ import annotations

import argparse
import ast
import csv
import re
from pathlib import Path

import pytest
import yaml

from fedcluster.algorithms import ALGORITHMS
from fedcluster.cli import _overrides, build_parser, main
from fedcluster.config.overrides import run_slug
from fedcluster.config.schema import resolve_config
from fedcluster.errors import ConfigError
from fedcluster.experiment.catalog import ALGORITHMS as DESCRIBED
from fedcluster.experiment.catalog import sections
from tests.helpers import digits_config

SRC = Path(__file__).resolve().parents[1] / "src" / "fedcluster"


def _parser_flags() -> set[str]:
    flags = set()
    parser = build_parser()
    todo = [parser]
    while todo:
        p = todo.pop()
        for action in p._actions:
            flags.update(o for o in action.option_strings if o.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    return flags


def _string_literals(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def test_every_flag_an_error_message_suggests_exists():
    files = [
        *sorted((SRC / "data").glob("*.py")),
        SRC / "cli.py",
        SRC / "config/schema.py",
        SRC / "config/overrides.py",
        *sorted((SRC / "reporting").glob("*.py")),
    ]
    suggested = {
        flag: path.name
        for path in files
        for text in _string_literals(path)
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)
    }
    assert "--download" in suggested  # data/sources.py's missing-dataset error
    missing = {f: where for f, where in suggested.items() if f not in _parser_flags()}
    assert not missing, f"flags suggested but not accepted by the CLI: {missing}"


def test_download_flag_sets_data_download():
    args = build_parser().parse_args(["run", "--download"])
    assert _overrides(args)["data"]["download"] is True
    config = resolve_config(None, "quickstart", [], _overrides(args))
    assert config.data.download is True


def test_compare_keeps_the_presets_algorithm_params():
    config = resolve_config(None, "cflgt-s1", [], algorithms=["ifca"])
    assert [(a.name, a.params) for a in config.algorithms] == [("ifca", {"n_clusters": 5})]
    # an algorithm the preset lacks gets its defaults; order follows --algorithms
    config = resolve_config(None, "cflgt-s1", [], algorithms=["jgl", "cflgt"])
    assert [(a.name, a.params) for a in config.algorithms] == [
        ("jgl", {}),
        ("cflgt", {"pretrain_rounds": 25}),
    ]


def test_set_addresses_an_algorithm_by_name_or_label():
    config = resolve_config(None, "cflgt-s1", ["algorithms.ifca.n_clusters=3"], algorithms=["ifca"])
    assert config.algorithms[0].params == {"n_clusters": 3}
    config = resolve_config(None, "fedgroup-mnist", ["algorithms.fedgroup-madc.params.n_groups=4"])
    by_label = {a.label: a.params for a in config.algorithms}
    assert by_label["fedgroup-madc"]["n_groups"] == 4 and by_label["fedgroup-edc"]["n_groups"] == 3
    with pytest.raises(ConfigError, match="no algorithm labelled or named 'jgl'"):
        resolve_config(None, "cflgt-s1", ["algorithms.jgl.lam=0.3"])


def test_sweep_gives_one_labelled_entry_per_combination():
    config = resolve_config(
        None,
        "quickstart",
        [],
        algorithms=["jgl"],
        sweeps=["algorithms.jgl.lam=0.1,0.5", "algorithms.jgl.n_clusters=2,3"],
    )
    got = [(a.label, a.params["lam"], a.params["n_clusters"]) for a in config.algorithms]
    assert got == [
        ("jgl(lam=0.1,n_clusters=2)", 0.1, 2),
        ("jgl(lam=0.1,n_clusters=3)", 0.1, 3),
        ("jgl(lam=0.5,n_clusters=2)", 0.5, 2),
        ("jgl(lam=0.5,n_clusters=3)", 0.5, 3),
    ]
    with pytest.raises(ConfigError, match="--sweep"):
        resolve_config(None, "quickstart", [], sweeps=["train.lr=0.1,0.2"])


def test_compare_sweep_of_jgl_lambda_runs_into_one_report(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(digits_config("tiny", rounds=2)))
    out = tmp_path / "run"
    args = [
        "compare",
        str(config),
        "--algorithms",
        "jgl",
        "--sweep",
        "algorithms.jgl.lam=0.1,0.2,0.5",
        "--quiet",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"report: {out / 'report.html'}"
    with open(out / "metrics.csv") as f:
        labels = list(dict.fromkeys(r["algorithm"] for r in csv.DictReader(f)))
    assert labels == ["jgl(lam=0.1)", "jgl(lam=0.2)", "jgl(lam=0.5)"]
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert [a["params"]["lam"] for a in saved["algorithms"]] == [0.1, 0.2, 0.5]
    md = (out / "report.md").read_text()
    assert all(f"| {label}" in md for label in labels)


def test_run_names_tell_different_sets_apart():
    a = run_slug(["data.dataset=fashion-mnist"])
    b = run_slug(["data.dataset=mnist"])
    assert a and b and a != b and run_slug([]) == ""
    long = [f"algorithms.{i}.params.lam=0.{i}" for i in range(9)]
    assert run_slug(long) != run_slug(long[:-1]) and len(run_slug(long)) <= 60


def test_list_algorithms_shows_paper_and_params(capsys):
    assert main(["list", "algorithms"]) == 0
    out = capsys.readouterr().out
    for name, cls in ALGORITHMS.items():
        assert re.search(rf"^  {re.escape(name)}\s+\S", out, re.M), name
        for field, info in cls.Params.model_fields.items():
            assert f"{field} = " in out
            if info.description:
                assert info.description in out
    assert "lam = 0.2  weight λ of the similarity (eq. 4)" in out


def test_every_registered_entry_is_described():
    # algorithms that ship with fedcluster (tests may register their own)
    shipped = {n for n, cls in ALGORITHMS.items() if cls.__module__.startswith("fedcluster.")}
    assert set(DESCRIBED) == shipped
    for title, items in sections().items():
        for name, text, _ in items:
            assert text and text != "(no description)", f"{title}: {name}"


def test_show_prints_the_resolved_preset(capsys):
    assert main(["show", "cflgt-s1", "--set", "rounds=7"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["rounds"] == 7 and shown["name"] == "cflgt-s1"
    assert shown["algorithms"][1] == {"name": "ifca", "label": "ifca", "params": {"n_clusters": 5}}
