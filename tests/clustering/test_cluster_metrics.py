"""Honest cluster metrics: purity ceiling with fewer clusters than groups; n_clusters before."""

from __future__ import annotations

import csv
import itertools
import json
import logging
import math

import numpy as np
import pytest

from fedcluster.clustering.validity import purity, purity_ceiling
from fedcluster.config.schema import resolve_config
from fedcluster.errors import ConfigError
from fedcluster.experiment.metrics import cluster_columns, format_row
from fedcluster.experiment.runner import Experiment


def _brute_force_ceiling(groups: np.ndarray, k: int) -> float:
    """Best purity over every assignment of the clients onto exactly k non-empty clusters."""
    best = 0.0
    for labels in itertools.product(range(k), repeat=len(groups)):
        if len(set(labels)) == k:
            best = max(best, purity(groups, np.array(labels)))
    return best


@pytest.mark.parametrize("sizes", [[3, 2, 1], [2, 2, 2], [4, 1, 1], [1, 1, 1, 1, 2], [5, 1]])
def test_purity_ceiling_matches_brute_force(sizes):
    groups = np.repeat(np.arange(len(sizes)), sizes)
    for k in range(1, min(len(groups), 4) + 1):
        assert purity_ceiling(sizes, k) == pytest.approx(_brute_force_ceiling(groups, k))


def test_purity_ceiling_fedgroup_case_and_bad_input():
    assert purity_ceiling([10] * 10, 3) == pytest.approx(0.3)  # m = 3 against 10 class pairs
    assert purity_ceiling([10] * 10, 12) == 1.0
    with pytest.raises(ConfigError, match="n_clusters"):
        purity_ceiling([1, 2], 0)
    with pytest.raises(ConfigError, match="group_sizes"):
        purity_ceiling([1, -2], 1)


def test_cluster_columns_before_clustering_are_empty():
    cols = cluster_columns(np.full(4, -1), np.array([0, 0, 1, 1]))
    assert math.isnan(cols["n_clusters"]) and math.isnan(cols["purity"])
    assert format_row(cols)[11] == ""  # the n_clusters cell of metrics.csv
    cols = cluster_columns(np.array([0, 0, 0, -1]), np.array([0, 0, 1, 1]))
    assert cols["n_clusters"] == 1.0 and cols["n_groups"] == 2.0
    assert cols["purity_ceiling"] == pytest.approx(2 / 3)  # 3 assigned clients, groups 2 + 1


def test_cflgt_pretraining_n_clusters_empty_and_shortfall_reported(tmp_path, caplog):
    config = resolve_config(
        None,
        "quickstart",
        [
            "data.dataset=digits",
            "data.partition={name: rotation, n_groups: 2, base: iid, "
            "base_options: {n_clients: 6, test_fraction: 0.2}}",
            "model.options={hidden: [8]}",
            "rounds=3",
            "algorithms=[{name: cflgt, params: {pretrain_rounds: 2}}, {name: fedavg},"
            " {name: flhc, params: {pretrain_rounds: 2, n_clusters: 1}}]",
        ],
    )
    with caplog.at_level(logging.INFO, logger="fedcluster"):
        Experiment(config).run(tmp_path, progress=False)
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["algorithm"] == "cflgt"]
    assert [r["n_clusters"] for r in rows[:2]] == ["", ""]
    assert float(rows[2]["n_clusters"]) >= 1
    jobs = {j["algorithm"]: j for j in json.loads((tmp_path / "summary.json").read_text())["jobs"]}
    cflgt = jobs["cflgt"]
    n = int(cflgt["final_n_clusters"])
    ceiling = 1.0 if n >= 2 else 0.5  # two groups of 3
    assert cflgt["final_purity_ceiling"] == pytest.approx(ceiling)
    assert jobs["fedavg"]["final_purity_ceiling"] is None
    assert jobs["flhc"]["final_purity_ceiling"] == pytest.approx(0.5)  # 1 cluster, 2 groups
    shortfall = [r.getMessage() for r in caplog.records if "ground-truth groups" in r.getMessage()]
    assert len(shortfall) == (2 if n < 2 else 1)
    assert any(m.startswith("flhc seed 0: 1 clusters for 2") for m in shortfall)
