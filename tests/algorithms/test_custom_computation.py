"""A new algorithm with its own client computation, defined here only (nothing under src/).

Each client returns the mean of its training labels, or the loss of the model
the server sends (computations written for one client, ``run_one_client``,
against the public :class:`ClientContext`: its data, the model, the helpers);
the server splits the clients at the median of those values into two clusters
and runs FedAvg in each. The same algorithm runs
in the simulator and on Flower's simulation engine with equal metrics: the
ClientApp finds the computation by its registered name and imports this module
on the node.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import torch
from pydantic import Field

from fedcluster.algorithms.base import (
    Algorithm,
    AlgorithmParams,
    RoundOutput,
    State,
    register,
    weighted_loss,
)
from fedcluster.config.schema import validate_config
from fedcluster.engine.flat import weighted_average
from fedcluster.experiment.runner import Experiment
from fedcluster.protocol.client_side import ClientBatch, ClientContext
from fedcluster.protocol.computation import (
    ClientComputation,
    Payload,
    ReplyField,
    Request,
    register_computation,
)
from tests.helpers import FLOAT_BYTES, INT_BYTES

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def label_mean(client: ClientContext, request: Request) -> Payload:
    """What one client computes from its own data: the mean of its training labels."""
    return {"mean": client.y_train.double().mean().float()}


LABEL_MEAN = register_computation(
    ClientComputation(
        name="test-label-mean",
        reply={"mean": ReplyField(())},
        run_one_client=label_mean,
        exempt_because="a test statistic: no privacy is claimed for it",
    )
)


def model_loss(client: ClientContext, request: Request) -> Payload:
    """A statistic that needs the model: the received model's mean training loss, by the
    context's evaluation helper and by a forward pass of the model module itself."""
    row = request.shared["model"]
    correct, count, loss_sum = client.evaluate(row, split="train")
    with torch.no_grad():
        logits = client.module(row)(client.x_train)
    by_hand = torch.nn.functional.cross_entropy(logits, client.y_train)
    assert abs(float(by_hand) - loss_sum / count) < 1e-5  # the helper is the module's loss
    return {"mean": torch.tensor(loss_sum / count, dtype=torch.float32)}


MODEL_LOSS = register_computation(
    ClientComputation(
        name="test-model-loss",
        reply={"mean": ReplyField(())},
        run_one_client=model_loss,
        exempt_because="a test statistic: no privacy is claimed for it",
    )
)


@dataclass
class LabelSplitState(State):
    models: torch.Tensor
    assign: np.ndarray


class LabelSplitParams(AlgorithmParams):
    rounds_between_splits: int = Field(100, ge=1)
    statistic: Literal["label-mean", "model-loss"] = "label-mean"
    at_init: bool = Field(False, description="ask the statistic in init_state, not round 1")


@register
class LabelSplit(Algorithm[LabelSplitParams, LabelSplitState]):
    """Two clusters split at the median label mean; FedAvg within each."""

    name = "test-label-split"
    Params = LabelSplitParams
    StateType = LabelSplitState

    def init_state(self) -> LabelSplitState:
        state = LabelSplitState(
            models=self.ctx.init_row.unsqueeze(0).repeat(2, 1),
            assign=np.full(self.ctx.n_clients, -1, dtype=np.int64),
        )
        if self.params.at_init:  # a broadcast and a one-shot upload before round 1
            state = replace(state, assign=self._split(state, 0))
        return state

    def _split(self, state: LabelSplitState, rnd: int) -> np.ndarray:
        ctx = self.ctx
        if self.params.statistic == "label-mean":
            replies = ctx.ask(LABEL_MEAN, ctx.available_clients(), Request(), rnd)
        else:
            request = Request(shared={"model": ctx.init_row})
            replies = ctx.ask(MODEL_LOSS, ctx.available_clients(), request, rnd)
        means = replies["mean"].numpy()
        assign = state.assign.copy()
        assign[replies.clients] = (means > np.median(means)).astype(np.int64)
        return assign

    def run_round(
        self, state: LabelSplitState, rnd: int, selected: np.ndarray
    ) -> RoundOutput[LabelSplitState]:
        ctx = self.ctx
        if (state.assign < 0).all():
            state = replace(state, assign=self._split(state, rnd))
        losses, sizes = [], []
        models = list(state.models)
        for c in range(2):
            members = selected[state.assign[selected] == c]
            if not len(members):
                continue
            ex = ctx.exchange(members, state.models[c], rnd, ints=1)
            if len(ex.clients):
                weights = torch.as_tensor(ctx.train_sizes[ex.clients])
                models[c] = weighted_average(ex.rows, weights)
                losses.append(ex.loss)
                sizes.append(ctx.train_sizes[ex.clients])
        if not losses:
            return RoundOutput(state, float("nan"))
        state = replace(state, models=torch.stack(models))
        return RoundOutput(state, weighted_loss(torch.cat(losses), np.concatenate(sizes)))

    def eval_rows(self, state: LabelSplitState) -> tuple[torch.Tensor, np.ndarray]:
        return state.models, np.maximum(state.assign, 0)

    def clusters(self, state: LabelSplitState) -> np.ndarray:
        return state.assign.copy()


CONFIG = {
    "name": "custom-computation",
    "seeds": [0],
    "rounds": 3,
    "data": {
        "dataset": "mnist5k",
        "partition": {"name": "dirichlet", "n_clients": 6, "alpha": 0.3, "test_fraction": 0.2},
    },
    "model": {"name": "mlp", "options": {"hidden": [16]}},
    "train": {"lr": 0.1, "batch_size": 32, "epochs": 1},
    "algorithms": [
        {"name": "test-label-split"},
        {"name": "test-label-split", "label": "by-loss", "params": {"statistic": "model-loss"}},
    ],
}


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_new_computation_runs_in_the_simulator(tmp_path):
    config = validate_config(CONFIG)
    Experiment(config).run(tmp_path, progress=False)
    rows = _rows(tmp_path / "metrics.csv")
    assert [int(r["round"]) for r in rows] == [1, 2, 3] * 2
    assert all(float(r["accuracy"]) > 0.2 for r in rows[2::3])
    clusters = _rows(tmp_path / "clusters.csv")
    assert {r["cluster"] for r in clusters} == {"0", "1"}
    # round 1: every client's label mean (one float up, nothing down), then a model
    # each way and a sample count up per client
    d = sum(p.numel() for p in torch.nn.Linear(784, 16).parameters()) + 16 * 10 + 10
    train_down, train_up = 6 * d * FLOAT_BYTES, 6 * (d * FLOAT_BYTES + INT_BYTES)
    assert int(rows[0]["bytes_down"]) == train_down
    assert int(rows[0]["bytes_up"]) == 6 * FLOAT_BYTES + train_up
    # by-loss: the model is broadcast to each client too (d floats down)
    assert int(rows[3]["bytes_down"]) == 6 * d * FLOAT_BYTES + train_down
    assert int(rows[3]["bytes_up"]) == 6 * FLOAT_BYTES + train_up


def test_the_traffic_of_init_state_counts_in_round_1(tmp_path):
    """A broadcast and a one-shot upload in init_state are round 1's bytes, not dropped:
    the same totals as the same query made in round 1."""
    algorithms = [
        {"name": "test-label-split", "label": label, "params": {"statistic": "model-loss", **p}}
        for label, p in (("in-round", {}), ("at-init", {"at_init": True}))
    ]
    config = validate_config({**CONFIG, "rounds": 1, "algorithms": algorithms})
    Experiment(config).run(tmp_path, progress=False)
    in_round, at_init = _rows(tmp_path / "metrics.csv")
    d = sum(p.numel() for p in torch.nn.Linear(784, 16).parameters()) + 16 * 10 + 10
    broadcast = 6 * d * FLOAT_BYTES  # the init model to each of 6 clients
    assert int(at_init["bytes_down"]) == broadcast + 6 * d * FLOAT_BYTES  # + the training
    for column in ("bytes_down", "bytes_up", "accuracy"):
        assert at_init[column] == in_round[column]


def test_a_new_computation_runs_on_flower_with_the_simulators_numbers(tmp_path, monkeypatch):
    pytest.importorskip(
        "flwr", reason="the Flower backend needs `pip install 'fedcluster[flower]'`"
    )
    from fedcluster.flower.server import run_simulation

    # Flower's ClientApp processes import this module to find the computation.
    path = os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    config = validate_config(CONFIG)
    Experiment(config).run(tmp_path / "sim", progress=False)
    run_simulation(config, tmp_path / "flower", progress=False)
    sim, flower = _rows(tmp_path / "sim/metrics.csv"), _rows(tmp_path / "flower/metrics.csv")
    assert len(sim) == len(flower) == 6
    for a, b in zip(sim, flower, strict=True):
        for column in a:
            if not column.endswith("seconds"):
                assert a[column] == b[column], (a["round"], column)
    assert (tmp_path / "sim/clusters.csv").read_text() == (
        tmp_path / "flower/clusters.csv"
    ).read_text()


def test_the_client_context_runs_the_built_in_computations_helpers():
    """What one client gets from its ClientContext equals that client's share of the
    built-in batched computations (same loss, batch plans and derived streams)."""
    from fedcluster.algorithms.base import init_row
    from fedcluster.engine.client_computations import EVALUATE, LOSSES, TRAIN
    from fedcluster.engine.simulator import Simulator
    from fedcluster.models import build_model
    from fedcluster.protocol.batches import LocalTraining
    from tests.helpers import rotated_digits

    fed = rotated_digits(n_groups=2, clients_per_group=2, per_client=40)
    model = build_model("mlp", fed.input_shape, fed.n_classes, hidden=[8])
    sim = Simulator(model, fed, seed=3)
    rows = torch.stack([init_row(model, 3, "init", k) for k in range(2)])
    cfg, clients = LocalTraining(lr=0.1, batch_size=16), np.arange(4)
    settings = {"train": cfg, "round": 2}
    batch = ClientBatch(sim, clients)
    trained = TRAIN.batched_run(batch, Request(shared={"start": rows[0]}, settings=settings))
    losses = LOSSES.batched_run(batch, Request(shared={"models": rows}, settings=settings))
    evaluated = EVALUATE.batched_run(
        batch,
        Request(shared={"models": rows}, own={"model_index": torch.zeros(4, dtype=torch.int64)}),
    )
    for c in clients:
        ctx = ClientContext(sim, int(c))
        row, loss, steps = ctx.train(rows[0], cfg, 2)
        torch.testing.assert_close(row, trained["row"][c], rtol=1e-5, atol=1e-6)
        assert steps == int(trained["steps"][c]) == 3  # ceil(40 / 16) steps of one epoch
        torch.testing.assert_close(ctx.losses(rows, cfg, 2), losses["losses"][c])
        correct, count, loss_sum = ctx.evaluate(rows[0])
        assert (correct, count) == (int(evaluated["correct"][c]), int(evaluated["count"][c]))
        assert count == 20 and loss_sum == pytest.approx(float(evaluated["loss_sum"][c]))
        _, grads = ctx.losses_and_grads(rows, cfg, 2)
        assert grads.shape == (2, ctx.dim) and ctx.client == c and ctx.y_train.shape == (40,)
        manual = torch.nn.functional.cross_entropy(ctx.forward(rows[0], ctx.x_test), ctx.y_test)
        assert loss_sum / count == pytest.approx(float(manual), rel=1e-5)
