"""Methods, partitions and datasets as plugins (fedcluster.config.plugins).

Every plugin here lives outside ``src/``: a module written to ``tmp_path``, named
from YAML by its import path, or a small installed package whose
``mypkg-0.1.dist-info/entry_points.txt`` declares it (``importlib.metadata``
finds a ``.dist-info`` folder on ``sys.path`` as pip would have left it).
"""

from __future__ import annotations

import csv
import re
import textwrap
from pathlib import Path

import pytest
import yaml

from fedcluster.algorithms import ALGORITHMS
from fedcluster.algorithms.base import Algorithm, algorithm_class, register
from fedcluster.algorithms.fedavg import FedAvg
from fedcluster.cli import main
from fedcluster.config.schema import validate_config
from fedcluster.errors import ConfigError
from fedcluster.experiment.catalog import format_sections
from fedcluster.experiment.runner import Experiment
from tests.helpers import digits_config

# A server-momentum FedAvg (Hsu et al. 2019): with beta = 0 it is FedAvg exactly,
# which is what the runs below check against the built-in fedavg.
PLUGIN = '''
"""A user's method, outside fedcluster."""
from dataclasses import dataclass, replace

import numpy as np
import torch
from pydantic import Field

from fedcluster.algorithms.base import (
    Algorithm,
    AlgorithmParams,
    RoundOutput,
    State,
    weighted_loss,
)
from fedcluster.engine.flat import weighted_average


@dataclass
class MomentumState(State):
    model: torch.Tensor
    velocity: torch.Tensor


class MomentumParams(AlgorithmParams):
    beta: float = Field(0.9, ge=0.0, lt=1.0, description="server momentum")


class Momentum(Algorithm[MomentumParams, MomentumState]):
    """FedAvg with server momentum (FedAvgM)."""

    name = "momentum"
    Params = MomentumParams
    StateType = MomentumState

    def init_state(self):
        return MomentumState(self.ctx.init_row.clone(), torch.zeros(self.ctx.dim))

    def run_round(self, state, rnd, selected):
        ex = self.ctx.exchange(selected, state.model, rnd, ints=1)
        mean = weighted_average(ex.rows, torch.as_tensor(self.ctx.train_sizes[ex.clients]))
        velocity = self.params.beta * state.velocity + (mean - state.model)
        new = replace(state, model=state.model + velocity, velocity=velocity)
        return RoundOutput(new, weighted_loss(ex.loss, self.ctx.train_sizes[ex.clients]))

    def eval_rows(self, state):
        return state.model.unsqueeze(0), np.zeros(self.ctx.n_clients, dtype=np.int64)


def halves(y_train, y_test, rng, *, n_clients: int = 4):
    """Client i holds the i-th quarter of the samples (test: held out of its own)."""
    from fedcluster.data.partitions import iid

    return iid(y_train, y_test, rng, n_clients=n_clients)


def tiny_digits(*, data_dir, seed, n: int = 400):
    """The first n of scikit-learn's digits."""
    from dataclasses import replace

    from fedcluster.data.sources import load_dataset

    ds = load_dataset("digits")
    return replace(ds, name="tiny", train=replace(ds.train, x=ds.train.x[:n], y=ds.train.y[:n]))
'''


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A folder on sys.path holding the module ``userplugin`` and an installed
    package ``mypkg`` whose entry points name the same objects."""
    root = tmp_path / "site"
    (root / "mypkg").mkdir(parents=True)
    (root / "userplugin.py").write_text(PLUGIN)
    (root / "mypkg" / "__init__.py").write_text("from userplugin import *  # noqa\n")
    info = root / "mypkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mypkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        textwrap.dedent(
            """
            [fedcluster.algorithms]
            mymomentum = mypkg:Momentum

            [fedcluster.partitions]
            quarters = mypkg:halves

            [fedcluster.datasets]
            tiny-digits = mypkg:tiny_digits
            """
        )
    )
    monkeypatch.syspath_prepend(str(root))
    return root


def _metrics(path: Path) -> list[dict[str, str]]:
    with open(path / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def _same_numbers(a: list[dict[str, str]], b: list[dict[str, str]]) -> None:
    """Equal metrics to float32 rounding (w + (mean - w) is mean up to rounding)."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for column in x:
            if column == "algorithm" or column.endswith("seconds") or not x[column]:
                assert column == "algorithm" or x[column] or not y[column]
                continue
            assert float(x[column]) == pytest.approx(float(y[column]), rel=1e-5, nan_ok=True)


def test_an_algorithm_from_a_module_outside_src_runs_from_yaml_by_import_path(plugin_dir, tmp_path):
    config = digits_config("plugin", 2, [{"name": "userplugin:Momentum", "params": {"beta": 0}}])
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["run", str(path), "--out", str(tmp_path / "p"), "--quiet", "--no-report"]) == 0
    config["algorithms"] = [{"name": "fedavg"}]
    Experiment(validate_config(config)).run(tmp_path / "f", progress=False)
    plugin, fedavg = _metrics(tmp_path / "p"), _metrics(tmp_path / "f")
    assert plugin[0]["algorithm"] == "userplugin:Momentum"
    _same_numbers(plugin, fedavg)  # beta = 0: FedAvg


def test_the_algorithms_flag_takes_an_import_path(plugin_dir, tmp_path, capsys):
    out = tmp_path / "flag"
    args = ["run", "--algorithms", "userplugin:Momentum,fedavg", "--rounds", "1", "--quiet"]
    sets = ["--set", "data.dataset=digits", "--set", "model.options={hidden: [8]}"]
    sets += ["--set", "data.partition={name: iid, n_clients: 4, test_fraction: 0.2}"]
    assert main([*args, *sets, "--out", str(out), "--no-report"]) == 0
    assert {r["algorithm"] for r in _metrics(out)} == {"userplugin:Momentum", "fedavg"}


def test_an_installed_package_s_entry_points_are_found_and_listed(plugin_dir, tmp_path):
    config = digits_config("entry-points", 2, [{"name": "mymomentum", "params": {"beta": 0}}])
    config["data"] = {
        "dataset": "tiny-digits",
        "options": {"n": 300},
        "partition": {"name": "quarters", "n_clients": 3},
    }
    Experiment(validate_config(config)).run(tmp_path / "p", progress=False)
    config["algorithms"] = [{"name": "fedavg"}]
    config["data"] = {
        "dataset": "userplugin:tiny_digits",
        "options": {"n": 300},
        "partition": {"name": "iid", "n_clients": 3},
    }
    Experiment(validate_config(config)).run(tmp_path / "f", progress=False)
    _same_numbers(_metrics(tmp_path / "p"), _metrics(tmp_path / "f"))
    listed = format_sections("algorithms")
    assert re.search(r"mymomentum +\(plugin mypkg:Momentum\) FedAvg with server momentum", listed)
    assert "beta = 0.9  server momentum" in listed
    assert "quarters" in format_sections("partitions")
    assert "tiny-digits" in format_sections("datasets")


def test_a_duplicate_name_is_an_error_not_an_overwrite(plugin_dir):
    (plugin_dir / "mypkg-0.1.dist-info" / "entry_points.txt").write_text(
        "[fedcluster.algorithms]\nifca = mypkg:Momentum\n"
    )
    config = validate_config(digits_config("dup", 1, [{"name": "ifca"}]))
    with pytest.raises(ConfigError, match=r"\['ifca'\] take built-in names"):
        Experiment(config)

    class Other(FedAvg):
        name = "fedavg"

    with pytest.raises(ValueError, match="'fedavg' is taken by fedcluster.algorithms.fedavg"):
        register(Other)
    assert ALGORITHMS["fedavg"] is FedAvg


def test_unknown_and_unimportable_names_are_one_line_errors(plugin_dir):
    for name, message in [
        ("nosuch", "unknown algorithm 'nosuch'; allowed: .*mymomentum"),
        ("userplugin:Nope", "cannot be imported: module 'userplugin' has no attribute 'Nope'"),
        ("nomodule_xyz:Thing", "cannot be imported: No module named 'nomodule_xyz'"),
        ("userplugin:halves", "not a subclass of fedcluster.algorithms.base.Algorithm"),
    ]:
        config = validate_config(digits_config("bad", 1, [{"name": name}]))
        with pytest.raises(ConfigError, match=message) as err:
            Experiment(config)
        assert "\n" not in str(err.value)


def test_a_plugin_raising_at_import_is_named_and_the_others_still_list(plugin_dir, capsys):
    """A second installed package whose module raises while imported: listing algorithms
    names it with what it raised and lists the working plugin; running it is one line."""
    (plugin_dir / "brokenpkg.py").write_text("1 / 0\n")
    info = plugin_dir / "brokenpkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenpkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fedcluster.algorithms]\nbroken = brokenpkg:Broken\n")
    listed = format_sections("algorithms")
    assert re.search(r"broken +\(plugin brokenpkg:Broken\) .*raised ZeroDivisionError", listed)
    assert re.search(r"mymomentum +\(plugin mypkg:Momentum\) FedAvg with server momentum", listed)
    assert main(["list", "algorithms"]) == 0
    assert "mymomentum" in capsys.readouterr().out
    config = validate_config(digits_config("broken", 1, [{"name": "broken"}]))
    with pytest.raises(ConfigError, match="'brokenpkg:Broken' cannot be imported: it raised Zero"):
        Experiment(config)


def test_an_algorithm_that_declares_no_params_class_is_named(monkeypatch):
    bare = type("Bare", (Algorithm,), {"name": "bare"})
    monkeypatch.setitem(ALGORITHMS, "bare", bare)
    with pytest.raises(
        ConfigError, match=r"field 'algorithms.0.name': 'bare' \(.*Bare\) declares no Params class"
    ):
        algorithm_class("bare", "algorithms.0")
