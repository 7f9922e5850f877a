"""The Flower backend runs the same algorithms as the simulator, with the same numbers.

One run of every algorithm on Flower's simulation engine (Ray, one SuperNode
per client; about a minute, half of it Ray's start) against the batched
simulator on the same config.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("flwr", reason="the Flower backend needs `pip install 'fedcluster[flower]'`")

from fedcluster.algorithms import ALGORITHMS  # noqa: E402
from fedcluster.config.schema import validate_config  # noqa: E402
from fedcluster.errors import ConfigError  # noqa: E402
from fedcluster.experiment.client_results import read_clients  # noqa: E402
from fedcluster.experiment.runner import Experiment  # noqa: E402
from fedcluster.flower.server import check_supported, run_simulation  # noqa: E402
from tests.helpers import assert_same_run, rotated_mnist5k  # noqa: E402

SMALL = {
    "ifca": {"n_clusters": 2},
    "jgl": {"n_clusters": 2, "lam": 0.2},
    "cflgt": {"pretrain_rounds": 1},
    "flhc": {"pretrain_rounds": 1},
    "flux": {"pretrain_rounds": 1},
    "cfl": {"warmup_rounds": 1},
    "fesem": {"n_clusters": 2},
    "wecfl": {"n_clusters": 2},
    "fedem": {"n_components": 2},
    "fedrc": {"n_clusters": 2},
    "fedsoft": {"n_clusters": 2},
    "cflgp": {"n_clusters": 2},
    "clove": {"n_clusters": 2},
    "fedgwc": {"eps": 1.0, "patience": 1},  # examined from round 1 on
}
SMALL_IFCA = {"name": "ifca", "params": SMALL["ifca"]}
CONFIG = {
    "name": "flower-vs-simulator",
    "seeds": [0],
    "rounds": 3,
    "data": rotated_mnist5k(6),
    "model": {"name": "mlp", "options": {"hidden": [32]}},
    "train": {"lr": 0.1, "batch_size": 32, "epochs": 1},
    "participation": {"fraction": 0.5},
    "algorithms": [  # every algorithm, with its clustering early enough to happen in 3 rounds
        *(
            {"name": name, "label": name, "params": SMALL.get(name, {})}
            for name in sorted(ALGORITHMS)
        ),
        {  # IFCA's weight sharing: the shared layers' bytes counted once on both backends
            "name": "ifca",
            "label": "ifca-shared",
            "params": {**SMALL["ifca"], "shared_layers": "all_but_last"},
        },
        {  # the private start's training exchange before round 1, on both backends
            "name": "ifca",
            "label": "ifca-private",
            "params": {**SMALL["ifca"], "init": "private"},
        },
    ],
}


def _same_run_on_both_backends(config, tmp_path: Path, rel: float = 0.0) -> list[dict[str, str]]:
    """Run ``config`` in the simulator and on Flower; assert equal metrics.csv (timing
    aside; numbers within ``rel``) and clusters.csv; the simulator's metrics rows."""
    Experiment(config).run(tmp_path / "sim", progress=False)
    results = run_simulation(config, tmp_path / "flower", progress=False)
    assert [(r.algorithm, r.seed) for r in results] == [
        (a.display_name(), 0) for a in config.algorithms
    ]
    sim = assert_same_run(tmp_path / "sim", tmp_path / "flower", rel)
    assert len(sim) == config.rounds * len(config.algorithms)
    # the per-client results too, and each run records the backend that ran it
    pd.testing.assert_frame_equal(
        read_clients(tmp_path / "sim"),
        read_clients(tmp_path / "flower"),
        check_exact=rel == 0.0,
        rtol=rel or 1e-5,
    )
    for backend, out in (("simulator", "sim"), ("flower", "flower")):
        summary = json.loads((tmp_path / out / "summary.json").read_text())
        assert summary["record"]["backend"] == backend
    return sim


def test_flower_run_writes_the_simulators_metrics_and_clusters(tmp_path):
    sim = _same_run_on_both_backends(validate_config(CONFIG), tmp_path)
    purity = [float(r["purity"]) for r in sim if r["algorithm"] == "ifca" and r["purity"]]
    assert purity and max(purity) > 0.5  # the comparison is about real clustering


@pytest.mark.parametrize(
    "algorithm",
    [
        {"name": "dcfl", "params": {"n_clusters": 2, "choice_on_device": True}},
        {"name": "fedgroup", "params": {"n_groups": 2, "choice_on_device": True}},
    ],
    ids=["dcfl-device", "fedgroup-device"],
)
def test_a_choice_by_released_directions_under_central_dp_on_flower(tmp_path, algorithm):
    """DCFL's eq. 6 and FedGroup's eq. 9 on the devices under central DP: the directions'
    noise z_Δ·C_t/n_k travels in each message's settings, the nodes choose and train as
    the simulator does, and the noisy aggregates and ε are the same."""
    config = validate_config(
        {
            **CONFIG,
            "algorithms": [algorithm],
            "privacy": {"mode": "central", "count_noise": 1.0},
        }
    )
    sim = _same_run_on_both_backends(config, tmp_path)
    assert all(float(r["epsilon"]) > 0 for r in sim)


def test_secure_aggregation_by_flowers_secagg_plus_equals_the_simulator(tmp_path):
    """DP-FedAvg, and IFCA (from random models and from the private start), JGL and DCFL
    choosing on the devices, under central DP with secure aggregation:
    the nodes' vectors go through Flower's SecAgg+ (quantized, masked), the server
    unmasks only their sum and releases the same noisy models as the simulator, whose
    sums are exact. Each entry of a sum is within one quantization step per node
    (2R/Q = 2·16/2³⁰ ≈ 3·10⁻⁸ for 3 nodes of one client), below the float32 rounding
    of the models (about 6·10⁻⁸ at |w| ≈ 1), so the runs agree to float32 rounding:
    metrics within 1e-5, the same clusters and ε."""
    secure = {"n_clusters": 2, "choice_on_device": True}
    config = validate_config(
        {
            **CONFIG,
            "algorithms": [
                {"name": "fedavg"},
                {"name": "ifca", "params": secure},
                {"name": "jgl", "params": {**secure, "lam": 0.2, "empty_cluster_fix": False}},
                {"name": "dcfl", "params": secure},
                {  # the private start's 8 sums too
                    "name": "ifca",
                    "label": "ifca-private",
                    "params": {**secure, "init": "private", "private_start": {"sketch_dim": 8}},
                },
            ],
            # a large ε: noise small enough that the sums, not the noise, make the models
            "privacy": {
                "mode": "central",
                "epsilon": 1e4,
                "count_noise": 1.0,
                "secure_aggregation": True,
            },
        }
    )
    sim = _same_run_on_both_backends(config, tmp_path, rel=1e-5)
    assert all(float(r["epsilon"]) > 0 for r in sim)
    accuracy = [float(r["accuracy"]) for r in sim if r["round"] == "3"]
    assert min(accuracy) > 0.3  # far above chance (0.1): the sums trained real models


def test_a_secure_round_of_one_node_releases_nothing(tmp_path):
    """One node's sum would be its own update: a round that asks a single node fails its
    client (recorded as failed), releases nothing and spends nothing."""
    config = validate_config(
        {
            **CONFIG,
            "rounds": 2,
            "participation": {"count": 1},
            "algorithms": [{"name": "fedavg"}],
            "privacy": {"mode": "central", "count_noise": 1.0, "secure_aggregation": True},
        }
    )
    run_simulation(config, tmp_path, progress=False)
    with (tmp_path / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["failed"] for r in rows] == ["1", "1"]
    assert all(r["loss"] == "" or r["loss"] == "nan" for r in rows)
    assert [float(r["epsilon"]) for r in rows] == [0.0, 0.0]
    assert rows[0]["accuracy"] == rows[1]["accuracy"]  # the initial model, unchanged


@pytest.mark.parametrize("mode", ["client", "record"])
def test_local_dp_on_flower_draws_the_simulators_noise_on_the_nodes(tmp_path, mode):
    """Client-level noise and DP-SGD noise drawn on the nodes equal the simulator's; a
    client out of budget (one upload each here) withholds its upload on its node.

    Record level to float rounding: Poisson batches differ in size between the
    members of a simulator group, so its padded sums run in another order than a
    node's.
    """
    config = validate_config(
        {
            **CONFIG,
            "privacy": {"mode": mode, "epsilon": 5.0, "max_participations": 1},
            "algorithms": [{"name": "fedavg"}, {"name": "dcfl"}, SMALL_IFCA],
        }
    )
    sim = _same_run_on_both_backends(config, tmp_path, rel=0.0 if mode == "client" else 1e-5)
    assert all(float(r["epsilon"]) > 0 for r in sim)
    with open(tmp_path / "flower/events.csv", newline="") as f:
        withheld = [r for r in csv.DictReader(f) if r["kind"] == "withheld"]
    assert withheld  # a client out of budget withholds its upload on its node


def test_a_batchnorm_resnet_on_flower_gives_the_simulators_metrics(tmp_path):
    """A ResNet-8 with BatchNorm: its running statistics travel in the row on both
    backends, the nodes train in train() and evaluate in eval() as the simulator does.
    To float rounding: the simulator evaluates several clients' samples in one batch."""
    config = validate_config(
        {
            **CONFIG,
            "rounds": 2,
            "model": {"name": "fedcluster.models:resnet8", "options": {"width": 4}},
            "algorithms": [{"name": "fedavg"}, SMALL_IFCA],
        }
    )
    sim = _same_run_on_both_backends(config, tmp_path, rel=1e-5)
    assert max(float(r["accuracy"]) for r in sim) > 0.2  # it learns (10 classes)


@pytest.mark.parametrize(
    "change,field",
    [
        (
            {"scenario": {"drift": [{"kind": "redistribute", "rounds": [2]}]}},
            r"scenario\.drift\.0\.kind: 'redistribute'",
        ),
        (
            {"model": {"name": "fedcluster.models:resnet8", "buffers": "local"}},
            r"model\.buffers: 'local'",
        ),
    ],
)
def test_unsupported_settings_are_refused_before_anything_runs(change, field):
    config = validate_config({**CONFIG, **change})
    with pytest.raises(ConfigError, match=field):
        check_supported(config)
