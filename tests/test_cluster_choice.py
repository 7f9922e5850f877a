"""Test-time cluster choice (``fedcluster assign``): the rules against
hand computations, the choice on separated data, bad files, and a CLI round trip."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fedcluster
from fedcluster.cli import main
from fedcluster.engine.flat import ParamLayout
from fedcluster.errors import DataError
from fedcluster.experiment.cluster_choice import (
    ClusterModels,
    DeviceData,
    read_device_data,
    summarise,
)
from fedcluster.reporting import write_report


def _linear_models(weights: list[torch.Tensor], biases: list[torch.Tensor]) -> ClusterModels:
    """Cluster models that are linear layers with the given weights [C, D] and biases [C]."""
    c, d = weights[0].shape
    layout = ParamLayout(nn.Linear(d, c))
    rows = torch.stack(
        [torch.cat([w.reshape(-1), b]) for w, b in zip(weights, biases, strict=True)]
    )
    return ClusterModels("toy", 0, rows, [0, 1], [1, 1], layout, F.cross_entropy, (d,), c, True)


def test_entropy_confidence_and_loss_equal_a_hand_computation():
    # model 0 predicts uniformly over 3 classes; model 1 has logits (2, 0, 0) everywhere
    zero = torch.zeros(3, 2)
    models = _linear_models([zero, zero], [torch.zeros(3), torch.tensor([2.0, 0.0, 0.0])])
    x = torch.tensor([[1.0, -1.0], [0.5, 2.0]])
    y = torch.tensor([0, 2])
    got = models.assign(DeviceData(x, y))
    z = math.exp(2) + 2
    p = [math.exp(2) / z, 1 / z, 1 / z]
    h1 = -sum(q * math.log(q) for q in p)
    assert got.scores["entropy"] == pytest.approx([math.log(3), h1], rel=1e-12)
    assert got.scores["confidence"] == pytest.approx([1 / 3, p[0]], rel=1e-12)
    # loss: mean of -log p(y) over the two samples (labels 0 and 2)
    loss1 = (-math.log(p[0]) - math.log(p[2])) / 2
    assert got.scores["loss"] == pytest.approx([math.log(3), loss1], rel=1e-6)
    # model 1 is sure of class 0 but one label is 2: its loss is worse than uniform's
    assert loss1 > math.log(3)
    assert got.chosen == {"entropy": 1, "confidence": 1, "loss": 0}
    assert got.accuracy == [pytest.approx(0.5), pytest.approx(0.5)]  # argmax ties -> class 0


def test_separated_clusters_each_device_gets_its_own_clusters_model():
    # cluster 0's data lives in features 0-1, cluster 1's in features 2-3; each cluster
    # model reads only its own features, so on the other cluster's data it sees zeros
    gen = torch.Generator().manual_seed(0)
    w0 = torch.zeros(2, 4)
    w0[0, 0], w0[1, 1] = 4.0, 4.0
    w1 = torch.zeros(2, 4)
    w1[0, 2], w1[1, 3] = 4.0, 4.0
    models = _linear_models([w0, w1], [torch.zeros(2), torch.zeros(2)])
    for k in (0, 1):
        x = torch.zeros(50, 4)
        label = torch.randint(0, 2, (50,), generator=gen)
        x[torch.arange(50), 2 * k + label] = 1.0 + torch.rand(50, generator=gen)
        got = models.assign(DeviceData(x))  # no labels
        assert got.chosen == {"entropy": k, "confidence": k}
        assert "loss" not in got.scores and got.accuracy is None


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"y": np.zeros(3, np.int64)}, "no array 'x'"),
        ({"x": np.zeros((3, 5), np.float32)}, "the run's model takes (4,)"),
        ({"x": np.zeros((0, 4), np.float32)}, "holds no samples"),
        ({"x": np.full((3, 4), np.nan, np.float32)}, "3 of 3 samples have non-finite"),
        ({"x": np.full((2, 4), 1e9, np.float32)}, "inputs beyond"),
        ({"x": np.zeros((3, 4), np.int64)}, "holds int64 values"),
        ({"x": np.zeros((3, 4)), "y": np.array([0, 1, 7])}, "labels outside 0..2"),
        ({"x": np.zeros((3, 4)), "y": np.array([0, 1])}, "one label per sample (3)"),
        ({"x": np.zeros((3, 4)), "y": np.zeros(3)}, "not integer labels"),
        ({"x": np.zeros((3, 4)), "group": np.array([1, 2])}, "'group' must be one integer"),
    ],
)
def test_bad_files_give_one_line_naming_the_problem(tmp_path, arrays, message):
    path = tmp_path / "device.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataError) as err:
        read_device_data(path, (4,), 3)
    text = str(err.value)
    assert message in text and text.startswith(str(path)) and "\n" not in text


def test_missing_foreign_and_oversized_files_are_refused(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="file not found"):
        read_device_data(tmp_path / "none.npz", (4,), 3)
    with pytest.raises(DataError, match="not a regular file"):
        read_device_data(tmp_path, (4,), 3)
    text = tmp_path / "text.npz"
    text.write_text("x,y\n1,2\n")
    with pytest.raises(DataError, match=r"not a readable \.npz"):
        read_device_data(text, (4,), 3)
    big = tmp_path / "big.npz"
    np.savez_compressed(big, x=np.zeros((4000, 4), np.float32))  # 64 kB inside, tiny on disk
    monkeypatch.setattr("fedcluster.experiment.cluster_choice.MAX_DATA_BYTES", 10_000)
    with pytest.raises(DataError, match="decompresses to more than 10,000 bytes"):
        read_device_data(big, (4,), 3)


ROTATED_DIGITS = [
    "--set",
    "data.dataset=digits",
    "--set",
    "data.partition={name: rotation, n_groups: 2, base: iid, "
    "base_options: {n_clients: 4, test_fraction: 0.2}}",
    "--set",
    "algorithms=[{name: ifca, params: {n_clusters: 2}}, {name: fedavg}]",
    "--set",
    "model.options={hidden: [16]}",
    "--rounds",
    "2",
    "--quiet",
    "--no-report",
]


def test_cli_round_trip_on_a_finished_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", *ROTATED_DIGITS, "--out", str(out)]) == 0
    from fedcluster.config.schema import load_yaml, validate_config
    from fedcluster.data.configured import build_federation_for

    fed = build_federation_for(validate_config(load_yaml(out / "config.yaml")), 0)
    client = int(np.flatnonzero(fed.groups == 1)[0])
    part = fed.subset([client])
    data = tmp_path / "device.npz"
    np.savez(data, x=part.x_test.numpy(), y=part.y_test.numpy(), group=np.int64(1))
    capsys.readouterr()

    args = ["assign", str(out), "--data", str(data)]
    assert main([*args, "--json", "--record"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [(a["algorithm"], a["seed"]) for a in got] == [("ifca", 0), ("fedavg", 0)]
    api = fedcluster.assign(out, data, algorithms=["ifca"])[0]
    assert got[0]["scores"] == api.scores and got[0]["chosen"] == api.chosen
    assert got[1]["models"] == [0] and set(got[1]["chosen"].values()) == {0}
    # the labelled choice's accuracy is the share of the device's labels it predicts
    ifca = got[0]
    acc = ifca["accuracy"][ifca["models"].index(ifca["chosen"]["loss"])]
    assert ifca["chosen_accuracy"]["loss"] == acc and 0.0 <= acc <= 1.0

    with open(out / "assign.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["algorithm"], r["rule"]) for r in rows[:3]] == [
        ("ifca", "entropy"),
        ("ifca", "confidence"),
        ("ifca", "loss"),
    ]
    assert {r["group"] for r in rows} == {"1"} and {r["labelled_model"] for r in rows[:3]} == {
        str(ifca["chosen"]["loss"])
    }
    table = summarise(rows)
    assert table[0]["loss acc"] == f"{acc:.4f}"
    report = write_report([out])
    assert "Cluster choice for held-out devices" in report.with_suffix(".md").read_text()

    assert main([*args, "--algorithms", "ifca"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("ifca seed 0 on device.npz") and "| model | members |" in text

    np.savez(data, x=part.x_test.numpy()[..., :4])  # wrong shape: one line, exit 2
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "the run's model takes (1, 8, 8)" in err
    assert main(["assign", str(out), "--data", str(data), "--algorithms", "jgl"]) == 2
    assert "has no algorithm jgl (it has ifca, fedavg)" in capsys.readouterr().err
    (out / "checkpoints" / "fedavg-seed0.pt").unlink()
    assert main(args) == 2
    assert "fedavg seed 0 has not finished (round 0 of 2)" in capsys.readouterr().err


def test_flux_runs_offer_the_descriptor_rule(tmp_path):
    """A device holding a client's test data, unlabelled, gets by FLUX's descriptor the
    cluster model that client trains with (the run found the two rotation groups)."""
    out = tmp_path / "run"
    flux = [
        "--set",
        "data.partition={name: rotation, n_groups: 2, base: iid, "
        "base_options: {n_clients: 8, test_fraction: 0.2}}",
        "--set",
        "algorithms=[{name: flux, params: {pretrain_rounds: 0}}]",
    ]
    assert main(["run", *ROTATED_DIGITS, *flux, "--out", str(out)]) == 0
    from fedcluster.config.schema import load_yaml, validate_config
    from fedcluster.data.configured import build_federation_for

    fed = build_federation_for(validate_config(load_yaml(out / "config.yaml")), 0)
    with open(out / "clusters.csv", newline="") as f:
        final = [r for r in csv.DictReader(f) if r["round"] == "2"]
    cluster = {int(r["client"]): int(r["cluster"]) for r in final}
    assert len(set(cluster.values())) == 2
    for client in (0, 1):
        part = fed.subset([client])
        got = fedcluster.assign(out, DeviceData(part.x_test), algorithms=["flux"])[0]
        assert got.chosen["descriptor"] == cluster[client]
        assert "loss" not in got.chosen
