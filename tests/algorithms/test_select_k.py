"""``n_clusters: auto`` (fedcluster.algorithms.cluster_count): config errors, the run directory's
curve, the algorithm built with the chosen K, and resuming to the same metrics."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from torch import nn

import fedcluster
from fedcluster.algorithms import check_algorithms
from fedcluster.cli import main
from fedcluster.config.schema import load_yaml, validate_config
from fedcluster.data.configured import build_federation_for
from fedcluster.errors import ConfigError
from fedcluster.experiment.runner import resume
from fedcluster.reporting import figures
from fedcluster.reporting.document import _k_curves
from fedcluster.reporting.rundata import load_run
from tests.helpers import rotated_digits


def _check(name: str, params: dict) -> None:
    check_algorithms(validate_config({"algorithms": [{"name": name, "params": params}]}))


@pytest.mark.parametrize(
    ("name", "params", "match"),
    [
        ("ifca", {"n_clusters": "auto", "k_range": [1, 4]}, "k_range': expected"),
        ("jgl", {"n_clusters": "auto", "k_range": [5, 3]}, "k_range': expected"),
        ("fesem", {"n_clusters": "auto", "k_range": "2-8"}, "k_range': expected"),
        ("fedem", {"n_components": "auto", "k_range": [2, 2.5]}, "k_range': expected"),
        ("ifca", {"n_clusters": 4, "k_range": [2, 8]}, "applies only with n_clusters: auto"),
        ("fedgroup", {"n_clusters": "auto"}, "fedgroup takes n_groups"),
        ("fedavg", {"k_range": [2, 8]}, "fedavg has no cluster count"),
        ("flhc", {"n_clusters": "auto"}, "flhc has no cluster count"),
    ],
)
def test_a_misplaced_auto_or_a_bad_k_range_is_one_line(name, params, match):
    with pytest.raises(ConfigError, match=match) as err:
        _check(name, params)
    assert "\n" not in str(err.value) and "algorithms.0.params." in str(err.value)


@pytest.mark.parametrize(
    ("name", "field"),
    [
        ("ifca", "n_clusters"),
        ("jgl", "n_clusters"),
        ("fesem", "n_clusters"),
        ("wecfl", "n_clusters"),
        ("fedsoft", "n_clusters"),
        ("fedgroup", "n_groups"),
        ("fedem", "n_components"),
    ],
)
def test_auto_is_accepted_by_every_method_with_a_cluster_count(name, field):
    _check(name, {field: "auto", "k_range": [2, 6]})


def _model(input_shape, n_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, n_classes))


class KeptK(fedcluster.Callback):
    """The number of cluster models IFCA's state holds, and a kill after ``kill`` rounds."""

    def __init__(self, kill: int | None = None) -> None:
        self.k: list[int] = []
        self.kill = kill

    def on_round_end(self, job, rnd, row, state):
        self.k.append(state.models.shape[0])
        if rnd == self.kill:
            raise KeyboardInterrupt


def _run(out: Path, federation, k_range: list[int], callback: KeptK, k: int | str = "auto") -> None:
    params = {"n_clusters": k, "k_range": k_range} if k == "auto" else {"n_clusters": k}
    fedcluster.run(
        model=_model,
        federation=federation,
        algorithms=[("ifca", params)],
        rounds=2,
        train={"lr": 0.1, "batch_size": 16},
        config={"checkpoint_every": 1},
        out=out,
        report=False,
        callbacks=[callback],
        progress=False,
    )


def _table(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_the_run_directory_records_the_curve_and_the_job_runs_with_the_chosen_k(
    tmp_path, monkeypatch
):
    federation = rotated_digits(n_groups=3, clients_per_group=2, per_client=30)  # 6 clients
    kept = KeptK()
    _run(tmp_path / "full", federation, [2, 4], kept)
    rows = _table(tmp_path / "full" / "select_k.csv")
    assert [int(r["k"]) for r in rows] == [2, 3, 4]
    assert {(r["algorithm"], r["seed"], r["parameter"], r["criterion"]) for r in rows} == {
        ("ifca", "0", "n_clusters", "silhouette")
    }
    best = max(rows, key=lambda r: float(r["value"]))
    assert [r["chosen"] for r in rows] == ["1" if r is best else "0" for r in rows]
    assert kept.k == [int(best["k"])] * 2  # IFCA ran with the chosen K
    assert "n_clusters: auto" in (tmp_path / "full" / "config.yaml").read_text()
    run = load_run(tmp_path / "full")  # the report's section: a curve per job and a table
    assert figures.select_k(figures.entries([run])) is not None
    [shown] = _k_curves(run)
    assert shown["chosen K"] == best["k"]
    assert [shown[f"K={r['k']}"] for r in rows] == [f"{float(r['value']):.3f}" for r in rows]

    # the same job as with that K given, but for the warm-up's bytes in round 1: each of
    # the 6 clients receives w0 and uploads its model (d float32 each way)
    _run(tmp_path / "given", federation, [2, 4], KeptK(), k=int(best["k"]))
    full, given = (_table(tmp_path / d / "metrics.csv") for d in ("full", "given"))
    timing = ("client_seconds", "server_seconds", "eval_seconds")
    skip = ("bytes_up", "bytes_down", *timing)
    assert [{k: v for k, v in r.items() if k not in skip} for r in full] == [
        {k: v for k, v in r.items() if k not in skip} for r in given
    ]
    d = sum(p.numel() for p in _model((1, 8, 8), 10).parameters())
    for column in ("bytes_up", "bytes_down"):
        extra = [int(a[column]) - int(b[column]) for a, b in zip(full, given, strict=True)]
        assert extra == [6 * d * 4, 0], column

    # killed after round 1, resumed: K is read back, not chosen again; the same metrics
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path / "killed", federation, [2, 4], KeptK(kill=1))
    assert _table(tmp_path / "killed" / "select_k.csv") == rows

    def chosen_again(*args):
        raise AssertionError("a resumed job with a checkpoint warms up again")

    monkeypatch.setattr("fedcluster.experiment.runner.select_k", chosen_again)
    resume(tmp_path / "killed", progress=False, federation=federation)
    assert _table(tmp_path / "killed" / "select_k.csv") == rows
    resumed = _table(tmp_path / "killed" / "metrics.csv")
    assert [{k: v for k, v in r.items() if k not in timing} for r in resumed] == [
        {k: v for k, v in r.items() if k not in timing} for r in full
    ]


def test_a_k_range_beyond_the_clients_is_one_line(tmp_path):
    federation = rotated_digits(n_groups=2, clients_per_group=2, per_client=20)  # 4 clients
    with pytest.raises(ConfigError, match=r"k_range': \[2, 4\] needs K <= n - 1 = 3") as err:
        _run(tmp_path / "run", federation, [2, 4], KeptK())
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()


def test_fedcluster_assign_reads_an_auto_job_with_its_chosen_k(tmp_path):
    out = tmp_path / "run"
    args = ["run", "--set", "data.dataset=digits", "--set", "model.options={hidden: [16]}"]
    args += ["--set", "data.partition={name: rotation, n_groups: 2, base: iid, "]
    args[-1] += "base_options: {n_clients: 5, test_fraction: 0.2}}"
    args += ["--set", "algorithms=[{name: ifca, params: {n_clusters: auto}}]"]
    assert main([*args, "--rounds", "1", "--quiet", "--no-report", "--out", str(out)]) == 0
    [chosen] = [int(r["k"]) for r in _table(out / "select_k.csv") if r["chosen"] == "1"]
    assert [int(r["k"]) for r in _table(out / "select_k.csv")] == [2, 3, 4]  # [2, 8] capped

    fed = build_federation_for(validate_config(load_yaml(out / "config.yaml")), 0)
    part = fed.subset([0])
    data = tmp_path / "device.npz"
    np.savez(data, x=part.x_test.numpy(), y=part.y_test.numpy())
    [found] = fedcluster.assign(out, data, algorithms=["ifca"])  # its checkpoint is read
    assert found.models and set(found.models) <= set(range(chosen))
