"""The Python API without a preset, and resuming its runs from anywhere.

The user's model and data live in a module written to ``tmp_path`` (outside
``src/``), as a researcher's own code would: three hidden groups of real digits
(scikit-learn's), rotated by 0°, 90° and 180°.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import torch

import fedcluster
from fedcluster.cli import main
from fedcluster.config.schema import load_yaml, validate_config
from fedcluster.errors import FedclusterError
from fedcluster.experiment.runner import Experiment

USER_MODULE = """
import numpy as np
import torch
from torch import nn

from fedcluster import Federation
from tests.helpers import rotated_digits


def make_model(input_shape, n_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, n_classes))


def make_federation():
    return rotated_digits(n_groups=3, clients_per_group=2, per_client=40)


def smoothed(logits, targets):
    return torch.nn.functional.cross_entropy(logits, targets, label_smoothing=0.1)
"""

ALGORITHMS = [fedcluster.IFCA(n_clusters=3), "fedavg"]
SETTINGS = {"rounds": 3, "train": {"lr": 0.1, "batch_size": 16}, "config": {"checkpoint_every": 1}}


class Killed(Exception):
    """Stands for the process dying after a round."""


class KillAfter(fedcluster.Callback):
    def __init__(self, rnd: int) -> None:
        self.rnd = rnd

    def on_round_end(self, job, rnd, row, state):
        if rnd == self.rnd:
            raise Killed


@pytest.fixture
def user(tmp_path, monkeypatch):
    (tmp_path / "usermod.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "usermod", raising=False)
    import usermod

    return usermod


def _metrics(path: Path) -> list[dict[str, str]]:
    with open(path / "metrics.csv", newline="") as f:
        return [
            {k: v for k, v in row.items() if not k.endswith("seconds")} for row in csv.DictReader(f)
        ]


def test_a_run_with_factories_resumes_from_the_cli_to_the_same_metrics(user, tmp_path):
    threads = torch.get_num_threads()
    full = fedcluster.run(
        model=user.make_model,
        federation=user.make_federation,
        algorithms=ALGORITHMS,
        out=tmp_path / "full",
        report=False,
        **SETTINGS,
    )
    assert sorted(full.final_accuracy()) == ["fedavg", "ifca"]
    assert torch.get_num_threads() == threads  # the worker threads' setting is restored
    config = load_yaml(tmp_path / "full" / "config.yaml")
    assert config["model"]["name"] == "usermod:make_model"
    assert config["data"]["federation"] == "usermod:make_federation"
    assert config["algorithms"][0] == {"name": "ifca", "label": "ifca", "params": {"n_clusters": 3}}

    with pytest.raises(Killed):
        fedcluster.run(
            model=user.make_model,
            federation=user.make_federation,
            algorithms=ALGORITHMS,
            out=tmp_path / "killed",
            callbacks=[KillAfter(2)],
            **SETTINGS,
        )
    assert len(_metrics(tmp_path / "killed")) == 2
    assert main(["resume", str(tmp_path / "killed"), "--quiet"]) == 0
    assert _metrics(tmp_path / "killed") == _metrics(tmp_path / "full")
    assert (tmp_path / "killed" / "report.html").is_file()


def test_the_same_run_from_yaml_with_the_typed_params_as_mappings(user, tmp_path):
    # IFCA(n_clusters=3) from Python and {name: ifca, params: {n_clusters: 3}} from YAML
    api = fedcluster.run(
        model="usermod:make_model",
        federation="usermod:make_federation",
        algorithms=ALGORITHMS[:1],
        out=tmp_path / "api",
        report=False,
        **{**SETTINGS, "rounds": 2},
    )
    raw = {
        "rounds": 2,
        "train": {"lr": 0.1, "batch_size": 16},
        "model": {"name": "usermod:make_model"},
        "data": {"federation": "usermod:make_federation"},
        "algorithms": [{"name": "ifca", "params": {"n_clusters": 3}}],
    }
    Experiment(validate_config(raw)).run(tmp_path / "yaml", progress=False)
    assert _metrics(tmp_path / "yaml") == _metrics(api.path)
    assert api.column("accuracy", "ifca") == [float(r["accuracy"]) for r in _metrics(api.path)]


def test_a_run_with_objects_stops_in_one_line_on_the_cli_and_resumes_from_python(
    user, tmp_path, capsys
):
    model, federation = user.make_model((1, 8, 8), 10), user.make_federation()
    args = {"algorithms": ALGORITHMS, "report": False, **SETTINGS}
    fedcluster.run(model=model, federation=federation, out=tmp_path / "full", **args)
    with pytest.raises(Killed):
        fedcluster.run(
            model=model,
            federation=federation,
            out=tmp_path / "killed",
            callbacks=[KillAfter(2)],
            **args,
        )
    before = (tmp_path / "killed" / "metrics.csv").read_text()
    capsys.readouterr()
    assert main(["resume", str(tmp_path / "killed"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and "rebuilt" not in err
    assert "cannot rebuild" in err and "fedcluster.resume(" in err
    assert "model=..., federation=..." in err
    assert (tmp_path / "killed" / "metrics.csv").read_text() == before  # untouched

    other = user.make_federation()
    other.y_train[0] = (other.y_train[0] + 1) % 10
    with pytest.raises(FedclusterError, match="federation passed differs from the run's"):
        fedcluster.resume(tmp_path / "killed", model=model, federation=other)
    fedcluster.resume(tmp_path / "killed", model=model, federation=federation, report=False)
    assert _metrics(tmp_path / "killed") == _metrics(tmp_path / "full")


def test_bad_arguments_are_one_line_errors(user, tmp_path):
    def local_factory(input_shape, n_classes):
        return user.make_model(input_shape, n_classes)

    with pytest.raises(FedclusterError, match="cannot be imported by path"):
        fedcluster.run(model=local_factory, federation=user.make_federation, out=tmp_path / "a")
    with pytest.raises(FedclusterError, match="field 'algorithms.0.params.n_clusters'"):
        fedcluster.run(algorithms=[{"name": "ifca", "params": {"n_clusters": 0}}], out=tmp_path)
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        fedcluster.IFCA(n_clusters=0)  # the typed object validates as the YAML does


def test_a_factory_that_changed_since_the_run_stops_resume_in_one_line(user, tmp_path, capsys):
    with pytest.raises(Killed):
        fedcluster.run(
            model=user.make_model,
            federation=user.make_federation,
            algorithms=["fedavg"],
            out=tmp_path / "killed",
            callbacks=[KillAfter(2)],
            **SETTINGS,
        )
    source = Path(user.__file__)
    source.write_text(source.read_text().replace("nn.Linear(64, 16)", "nn.Linear(64, 32)"))
    sys.modules.pop("usermod")
    capsys.readouterr()
    assert main(["resume", str(tmp_path / "killed"), "--quiet", "--no-report"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"fedcluster: error: cannot resume {tmp_path}")
    assert "still match the run's checkpoints" in err


def test_a_loss_passed_from_python_is_recorded_so_that_resume_uses_it(user, tmp_path, capsys):
    args = {"algorithms": ["fedavg"], "report": False, **SETTINGS}
    factories = {"model": user.make_model, "federation": user.make_federation}
    full = fedcluster.run(out=tmp_path / "full", loss=user.smoothed, **factories, **args)
    assert load_yaml(full.path / "config.yaml")["train"]["loss"] == "usermod:smoothed"
    with pytest.raises(Killed):
        fedcluster.run(
            out=tmp_path / "killed",
            loss=user.smoothed,
            callbacks=[KillAfter(2)],
            **factories,
            **args,
        )
    assert main(["resume", str(tmp_path / "killed"), "--quiet"]) == 0  # by its import path
    assert _metrics(tmp_path / "killed") == _metrics(full.path)

    def local_loss(logits, targets):  # no import path: only Python can resume it
        return user.smoothed(logits, targets)

    with pytest.raises(Killed):
        fedcluster.run(
            out=tmp_path / "local", loss=local_loss, callbacks=[KillAfter(2)], **factories, **args
        )
    recorded = load_yaml(tmp_path / "local" / "config.yaml")["train"]["loss"]
    assert recorded.startswith("given:") and recorded.endswith("local_loss")
    capsys.readouterr()
    assert main(["resume", str(tmp_path / "local"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "loss=..." in err and "local_loss" in err
    fedcluster.resume(tmp_path / "local", loss=local_loss, report=False)
    assert _metrics(tmp_path / "local") == _metrics(full.path)


def test_run_takes_a_yaml_path_as_its_config_and_names_a_wrong_type(tmp_path):
    """``config`` may be a YAML file's path (as on the command line); another type is one
    ConfigError naming the argument, not a traceback from dict()."""
    from fedcluster.api import build_config
    from fedcluster.errors import ConfigError

    path = tmp_path / "c.yaml"
    path.write_text("participation: {fraction: 0.5}\ntrain: {lr: 0.2}\n")
    built = build_config(algorithms=["fedavg"], rounds=2, seeds=[0], name="x", config=str(path))
    assert built.participation.fraction == 0.5 and built.train.lr == 0.2
    assert build_config(algorithms=["fedavg"], rounds=2, seeds=[0], name="x", config=path) == built
    with pytest.raises(ConfigError, match="config: expected an ExperimentConfig, a mapping"):
        build_config(algorithms=["fedavg"], rounds=2, seeds=[0], name="x", config=3)
