"""Warnings from a method's own diagnostics (fedcluster.experiment.health): the rules on
hand-made inputs, and the runner writing them to events.csv, one line each."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fedcluster.config.schema import validate_config
from fedcluster.experiment import health
from fedcluster.experiment.cluster_choice import Assignment
from fedcluster.experiment.runner import Experiment

CONFIG = {
    "seeds": [0],
    "rounds": 2,
    "data": {
        "dataset": "mnist5k",
        "partition": {"name": "iid", "n_clients": 6, "samples_per_client": 40},
    },
    "model": {"name": "mlp", "options": {"hidden": [8]}},
}


def test_one_cluster_counts_present_assigned_clients_only() -> None:
    present = np.array([True, True, True, False])
    assert health.one_cluster(np.array([2, 2, -1, 5]), present) is not None
    assert "all 2 clients" in str(health.one_cluster(np.array([2, 2, -1, 5]), present))
    assert health.one_cluster(np.array([2, 3, 2, 2]), present) is None
    assert health.one_cluster(np.array([2, -1, -1, 2]), present) is None  # one client


def test_near_tie_compares_the_chosen_k_with_the_runner_up() -> None:
    line = health.near_tie({2: 0.0809, 3: 0.0811, 4: 0.02}, 3)
    assert line is not None and "0.0811" in line and "0.0809" in line and "K=2" in line
    assert health.near_tie({2: 0.05, 3: 0.2, 4: 0.1}, 3) is None  # margin 0.1
    assert health.near_tie({2: 0.3}, 2) is None  # nothing to compare with


def _assignment(
    algorithm: str, chosen: int, models: list[int], group: int | None = None
) -> Assignment:
    scores = {r: [0.0] * len(models) for r in ("entropy", "confidence")}
    return Assignment(
        algorithm, 0, "d", group, 10, models, [1] * len(models), scores,
        {"entropy": chosen, "confidence": models[0]},
    )  # fmt: skip


def test_same_model_flags_a_rule_that_tells_no_device_apart() -> None:
    same = [_assignment("ifca", 1, [0, 1]), _assignment("ifca", 1, [0, 1])]
    apart = [_assignment("fesem", 0, [0, 1]), _assignment("fesem", 1, [0, 1])]
    single = [_assignment("fedavg", 0, [0]), _assignment("fedavg", 0, [0])]
    one_group = [_assignment("wecfl", 1, [0, 1], group=3), _assignment("wecfl", 1, [0, 1], 3)]
    found = health.same_model(same + apart + single + one_group, ["entropy", "confidence"])
    # ifca: both rules chose one model; fesem: confidence did (models[0]) but entropy did not
    assert [(a, rule in line) for a, _, line in found for rule in ["'entropy'"]] == [
        ("ifca", True),
        ("ifca", False),
        ("fesem", False),
    ]


def test_a_method_left_in_one_cluster_warns_in_events_csv(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = validate_config(
        {**CONFIG, "algorithms": [{"name": "cfl", "params": {"warmup_rounds": 50}}]}
    )
    with caplog.at_level(logging.WARNING):
        Experiment(config).run(tmp_path / "run", progress=False)
    events = pd.read_csv(tmp_path / "run" / "events.csv")
    warnings = events[events["kind"] == health.WARNING]
    assert len(warnings) == 1 and int(warnings["round"].iloc[0]) == 2
    assert "one cluster" in warnings["detail"].iloc[0]
    assert int(warnings["client"].iloc[0]) == health.NO_CLIENT
    assert any("one cluster" in r.message and "\n" not in r.message for r in caplog.records)


def test_a_near_tie_in_automatic_k_warns_in_round_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(health, "NEAR_TIE", 10.0)  # any margin of silhouettes is a tie
    config = validate_config(
        {**CONFIG, "algorithms": [{"name": "ifca", "params": {"n_clusters": "auto"}}]}
    )
    Experiment(config).run(tmp_path / "run", progress=False)
    events = pd.read_csv(tmp_path / "run" / "events.csv")
    ties = events[(events["kind"] == health.WARNING) & events["detail"].str.contains("near tie")]
    assert len(ties) == 1 and int(ties["round"].iloc[0]) == 1
