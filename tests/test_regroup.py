"""scenario.drift.regroup: a drifting client moves to another ground-truth group, and the
clustering is measured against the moved groups, job by job."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from sklearn.metrics import adjusted_rand_score

from fedcluster.config.schema import validate_config
from fedcluster.data.configured import build_federation_for
from fedcluster.errors import ConfigError
from fedcluster.experiment.runner import Experiment

MOVED = [0, 1, 2, 3]
CONFIG = {
    "seeds": [0],
    "rounds": 3,
    "data": {
        "dataset": "digits",
        "partition": {"name": "iid", "n_clients": 8},
        "shift": {"kind": "feature", "groups": 2},  # rotations 0 and 180 degrees
    },
    "model": {"name": "mlp", "options": {"hidden": [16]}},
    "scenario": {
        "drift": [
            {
                "kind": "rotate",
                "rounds": [2],
                "clients": MOVED,
                "angle": 180,
                "regroup": {0: 1, 1: 0},
            }
        ]
    },
    "algorithms": [{"name": "ifca", "params": {"n_clusters": 2}}, {"name": "fedavg"}],
}


def test_drifting_clients_move_group_and_the_ari_follows(tmp_path: Path) -> None:
    config = validate_config(CONFIG)
    before = build_federation_for(config, 0).groups
    assert before is not None
    after = before.copy()
    after[MOVED] = 1 - after[MOVED]
    Experiment(config).run(tmp_path, progress=False)
    clients = pd.read_csv(tmp_path / "clients.csv")
    for algorithm in ("ifca", "fedavg"):  # each job moves its own copy of the groups
        for rnd, truth in ((1, before), (2, after), (3, after)):
            rows = clients[(clients["algorithm"] == algorithm) & (clients["round"] == rnd)]
            assert rows.sort_values("client")["group"].tolist() == truth.tolist()
    clusters = pd.read_csv(tmp_path / "clusters.csv")
    metrics = pd.read_csv(tmp_path / "metrics.csv")
    for rnd, truth in ((1, before), (3, after)):
        mine = clusters[(clusters["algorithm"] == "ifca") & (clusters["round"] == rnd)]
        found = mine.sort_values("client")["cluster"].to_numpy()
        ari = metrics[(metrics["algorithm"] == "ifca") & (metrics["round"] == rnd)]["ari"].item()
        assert ari == pytest.approx(adjusted_rand_score(truth, found), abs=1e-12)
    events = pd.read_csv(tmp_path / "events.csv")
    drift = events[(events["kind"] == "drift") & (events["algorithm"] == "ifca")]
    assert sorted(drift["client"]) == MOVED
    for client, detail in zip(drift["client"], drift["detail"], strict=True):
        assert detail.endswith(f"group {before[client]} -> {after[client]}")


def test_regroup_needs_ground_truth_and_groups_from_zero(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="regroup"):
        validate_config({**CONFIG, "scenario": {"drift": [{"kind": "rotate", "rounds": [2],
                                                           "regroup": {-1: 0}}]}})  # fmt: skip
    plain = {**CONFIG, "data": {**CONFIG["data"], "shift": None}}
    with pytest.raises(ConfigError, match="no ground-truth groups"):
        Experiment(validate_config(plain)).run(tmp_path, progress=False)
