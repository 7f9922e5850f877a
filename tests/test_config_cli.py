"""Config validation with errors that name the field, presets, --set, and the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fedcluster.algorithms import check_algorithms
from fedcluster.cli import main
from fedcluster.config.schema import apply_set, list_presets, resolve_config, validate_config
from fedcluster.errors import ConfigError
from tests.helpers import TINY_RUN_SETS


def test_unknown_key_names_the_field_and_what_is_allowed():
    with pytest.raises(ConfigError) as err:
        validate_config({"train": {"lr": 0.1, "learning_rate": 3}})
    text = str(err.value)
    assert "train.learning_rate" in text and "unknown key" in text and "batch_size" in text


def test_bad_value_names_the_field_and_the_value():
    with pytest.raises(ConfigError, match=r"train\.lr.*greater than 0.*-1"):
        validate_config({"train": {"lr": -1}})


def test_unknown_algorithm_and_bad_algorithm_param():
    """The schema is a leaf; algorithm names and params are checked where algorithms are built."""

    def check(raw):
        check_algorithms(validate_config(raw))

    with pytest.raises(ConfigError, match="unknown algorithm 'fedavgg'.*allowed: .*fedavg"):
        check({"algorithms": [{"name": "fedavgg"}]})
    with pytest.raises(ConfigError, match=r"algorithms\.0\.params\.lam"):
        check({"algorithms": [{"name": "jgl", "params": {"lam": 2}}]})
    with pytest.raises(ConfigError, match=r"params\.lamda.*unknown key"):
        check({"algorithms": [{"name": "fedavg"}, {"name": "jgl", "params": {"lamda": 0.2}}]})


def test_duplicate_algorithms_need_labels():
    with pytest.raises(ConfigError, match="duplicate"):
        validate_config({"algorithms": [{"name": "fedavg"}, {"name": "fedavg"}]})
    ok = validate_config({"algorithms": [{"name": "fedavg"}, {"name": "fedavg", "label": "b"}]})
    assert [a.display_name() for a in ok.algorithms] == ["fedavg", "b"]


def test_set_overrides_nested_fields_and_list_items():
    raw = {"algorithms": [{"name": "jgl", "params": {"lam": 0.2}}]}
    out = apply_set(raw, "algorithms.0.params.lam=0.5")
    assert (
        out["algorithms"][0]["params"]["lam"] == 0.5
        and raw["algorithms"][0]["params"]["lam"] == 0.2
    )
    assert apply_set({}, "train.lr=0.1") == {"train": {"lr": 0.1}}
    with pytest.raises(ConfigError, match="dotted.key=value"):
        apply_set({}, "train.lr")
    with pytest.raises(ConfigError, match="not an index"):
        apply_set(raw, "algorithms.3.name=x")


def test_every_preset_validates():
    assert "quickstart" in list_presets()
    for name in list_presets():
        assert resolve_config(None, name).rounds >= 1


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(ConfigError, match="available: .*quickstart"):
        resolve_config(None, "nope")


def test_cli_reports_bad_config_without_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {lr: 0.1, epochz: 2}\n")
    assert main(["run", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "train.epochz" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_cli_never_writes_into_an_existing_directory_without_overwrite(tmp_path, capsys):
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.csv").write_text("keep me")
    assert main(["run", "--out", str(old), "--rounds", "1", "--quiet", "--no-report"]) == 0
    assert (old / "metrics.csv").read_text() == "keep me"
    assert (tmp_path / "old-2" / "summary.json").is_file()  # written beside it instead
    # --overwrite replaces run directories only: this one has no config.yaml
    args = ["run", "--out", str(old), "--rounds", "1", "--overwrite"]
    assert main(args) == 2
    assert "not a run directory" in capsys.readouterr().err
    assert (old / "metrics.csv").read_text() == "keep me"


def test_cli_list_shows_every_registry():
    out = subprocess.run(
        [sys.executable, "-m", "fedcluster.cli", "list"], capture_output=True, text=True, check=True
    ).stdout
    for word in (
        "algorithms:",
        "jgl",
        "ifca",
        "fedavg",
        "datasets:",
        "mnist5k",
        "partitions:",
        "cluster_table",
        "models:",
        "mlp",
        "presets:",
        "quickstart",
    ):
        assert word in out


def test_cli_run_prints_summary_table(tmp_path):
    args = [
        sys.executable,
        "-m",
        "fedcluster.cli",
        "run",
        "--quiet",
        "--out",
        str(tmp_path),
        "--rounds",
        "2",
        *TINY_RUN_SETS,
    ]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    assert "| fedavg" in out and "final acc %" in out
    assert (tmp_path / "summary.json").exists()
