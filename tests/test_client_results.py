"""clients.csv, RunResult.clients and the callbacks' per-client results: each row equals
a per-client evaluation computed by hand, and a resumed run has the same rows."""

from __future__ import annotations

import copy

import pandas as pd
import pytest
import torch
from torch import nn

import fedcluster
from fedcluster.engine.flat import ParamLayout
from fedcluster.experiment.client_results import CLIENT_COLUMNS
from fedcluster.reporting.document import build_sections
from fedcluster.reporting.rundata import load_run
from tests.helpers import rotated_digits

SETTINGS = {"rounds": 4, "train": {"lr": 0.1, "batch_size": 16}}


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))


class KeepStates(fedcluster.Callback):
    """Copies of each job's server state and per-client results at every round."""

    def __init__(self) -> None:
        self.states: dict[tuple[str, int], object] = {}
        self.results: dict[tuple[str, int], list[dict]] = {}

    def on_round_end(self, job, rnd, row, state):
        self.states[(job.label, rnd)] = copy.deepcopy(state)
        self.results[(job.label, rnd)] = list(job.client_results)


def by_hand(model: nn.Module, row: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
    """(correct, summed cross-entropy) of the model with parameters ``row`` on (x, y)."""
    net = copy.deepcopy(model)
    ParamLayout(net).load_into(net, row)
    with torch.no_grad():
        logits = net(x).double()
    loss = nn.functional.cross_entropy(logits, y, reduction="sum")
    return int((logits.argmax(1) == y).sum()), float(loss)


def test_clients_csv_rows_equal_a_per_client_evaluation_by_hand(tmp_path):
    federation = rotated_digits(n_groups=2, clients_per_group=3, per_client=40)
    model = small_model()
    keep = KeepStates()
    result = fedcluster.run(
        model=model,
        federation=federation,
        algorithms=["fedavg", fedcluster.IFCA(n_clusters=2)],
        out=tmp_path / "run",
        callbacks=[keep],
        config={"eval_every": 2},
        report=False,
        **SETTINGS,
    )
    clients = result.clients
    assert list(clients.columns) == CLIENT_COLUMNS
    # evaluation rounds only, every client once per (algorithm, round)
    assert sorted(set(clients["round"])) == [2, 4]
    assert len(clients) == 2 * 2 * federation.n_clients
    off = federation.test_offsets
    for row in clients.itertuples():
        state = keep.states[(row.algorithm, row.round)]
        if row.algorithm == "fedavg":
            assert pd.isna(row.cluster)
            model_row = state.global_model
        else:
            assert row.cluster == state.assign[row.client]
            model_row = state.models[row.cluster]
        x = federation.x_test[off[row.client] : off[row.client + 1]]
        y = federation.y_test[off[row.client] : off[row.client + 1]]
        correct, loss_sum = by_hand(model, model_row, x, y)
        assert row.samples == len(y)
        assert row.group == federation.groups[row.client]
        assert row.accuracy == pytest.approx(correct / len(y), abs=1e-12)
        # float32 logits summed over 20 samples: relative error a few float32 eps
        assert row.loss == pytest.approx(loss_sum / len(y), rel=1e-5)
    # the callbacks saw the same records as clients.csv holds
    for (label, rnd), records in keep.results.items():
        mine = clients[(clients.algorithm == label) & (clients["round"] == rnd)]
        assert len(records) == (len(mine) if rnd % 2 == 0 else 0)
        for record, row in zip(records, mine.itertuples(), strict=True):
            assert (record["client"], record["samples"]) == (row.client, row.samples)
            assert record["accuracy"] == row.accuracy
    # the report shows them
    sections = {s.key for s in build_sections([load_run(result.path)])}
    assert {"groups", "worst-clients", "cluster-size"} <= sections
    # the per-client rows pool to metrics.csv's accuracy
    for m in result.metrics:
        mine = clients[(clients.algorithm == m["algorithm"]) & (clients["round"] == m["round"])]
        if len(mine):
            correct = (mine.accuracy * mine.samples).round().sum()
            assert correct / mine.samples.sum() == pytest.approx(m["accuracy"], abs=1e-12)


class Killed(Exception):
    """Stands for the process dying after a round."""


class KillAfter(fedcluster.Callback):
    def __init__(self, rnd: int) -> None:
        self.rnd = rnd

    def on_round_end(self, job, rnd, row, state):
        if rnd == self.rnd:
            raise Killed


def test_a_resumed_run_has_the_uninterrupted_clients_csv_without_duplicates(tmp_path, caplog):
    federation = rotated_digits(n_groups=2, clients_per_group=2, per_client=40)
    model = small_model()
    common = {"model": model, "federation": federation, "report": False, **SETTINGS}
    algorithms = ["fedavg", fedcluster.IFCA(n_clusters=2)]
    whole = fedcluster.run(algorithms=algorithms, out=tmp_path / "whole", **common)
    with pytest.raises(Killed):  # killed after round 3, checkpoint of round 2
        fedcluster.run(
            algorithms=algorithms,
            out=tmp_path / "killed",
            callbacks=[KillAfter(3)],
            config={"checkpoint_every": 2},
            **common,
        )
    with caplog.at_level("WARNING", logger="fedcluster"):
        resumed = fedcluster.resume(
            tmp_path / "killed", model=model, federation=federation, report=False
        )
    assert resumed.clients.equals(whole.clients)
    # a normal resume restores nothing, so it says nothing of restored rows
    assert "restored" not in caplog.text
    assert "rebuilt" not in caplog.text


def test_a_run_directory_without_clients_csv_resumes_and_gains_the_later_rows(tmp_path):
    """A run started before clients.csv existed (here: the file deleted) resumes; the
    rounds after its checkpoint are recorded, the earlier ones cannot be."""
    federation = rotated_digits(n_groups=2, clients_per_group=2, per_client=40)
    model = small_model()
    out = tmp_path / "old"
    with pytest.raises(Killed):
        fedcluster.run(
            model=model,
            federation=federation,
            out=out,
            callbacks=[KillAfter(3)],
            config={"checkpoint_every": 2},
            report=False,
            **SETTINGS,
        )
    (out / "clients.csv").unlink()
    resumed = fedcluster.resume(out, model=model, federation=federation, report=False)
    assert sorted(set(resumed.clients["round"])) == [3, 4]
    assert len(resumed.clients) == 2 * federation.n_clients
