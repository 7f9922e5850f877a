"""A model passed from Python is used as given: its weights kept (``model.init: keep``,
the default) or re-initialised from the seed (``reset``); frozen parameters refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fedcluster
from fedcluster.algorithms.base import init_row
from fedcluster.config.schema import validate_config
from fedcluster.engine.flat import ParamLayout
from fedcluster.errors import ConfigError, DataError, FedclusterError
from fedcluster.experiment.runner import Experiment
from tests.helpers import rotated_digits


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))


def _pretrained(federation) -> nn.Module:
    """The model trained centrally on all clients' training data (full batch, Adam)."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(150):
        opt.zero_grad()
        nn.functional.cross_entropy(model(federation.x_train), federation.y_train).backward()
        opt.step()
    return model


def _accuracy(model: nn.Module, federation) -> float:
    with torch.no_grad():
        hits = model(federation.x_test).argmax(dim=1) == federation.y_test
    return float(hits.double().mean())


def _config(init: str | None = None):
    raw = {"rounds": 1, "algorithms": [{"name": "fedavg"}], "train": {"lr": 1e-6}}
    if init is not None:
        raw["model"] = {"init": init}
    return validate_config(raw)


@pytest.mark.parametrize("init", [None, "keep", "reset"])
def test_the_initial_row_is_the_given_weights_unless_reset(init):
    federation = rotated_digits(n_groups=1, clients_per_group=4, per_client=20)
    model = _model()
    experiment = Experiment(_config(init), model=model, federation=federation)
    (_, _, start), _ = experiment.setting(federation, seed=3)
    if init == "reset":
        assert torch.equal(start, init_row(model, 3, "init"))
    else:
        assert torch.equal(start, ParamLayout(model).flatten())


def test_a_pretrained_model_stays_pretrained(tmp_path):
    """One round of FedAvg at lr 1e-6 from a pretrained model: the accuracy is the
    pretrained model's (a prediction flips only where two logits are within ~1e-5);
    with ``init: reset`` it is back near chance."""
    federation = rotated_digits(n_groups=1, clients_per_group=4, per_client=80)
    model = _pretrained(federation)
    before = _accuracy(model, federation)
    assert before > 0.8  # the comparison is about a model worth keeping
    args = {"federation": federation, "rounds": 1, "train": {"lr": 1e-6}, "report": False}
    kept = fedcluster.run(model=model, out=tmp_path / "keep", **args)
    reset = fedcluster.run(
        model=model, out=tmp_path / "reset", config={"model": {"init": "reset"}}, **args
    )
    assert abs(kept.column("accuracy", "fedavg")[0] - before) <= 1 / len(federation.y_test)
    assert reset.column("accuracy", "fedavg")[0] < 0.5
    assert _accuracy(model, federation) == before  # the run left the module as it was


def test_frozen_parameters_are_refused_in_one_line():
    federation = rotated_digits(n_groups=1, clients_per_group=4, per_client=20)
    model = _model()
    model[1].weight.requires_grad_(False)
    with pytest.raises(ConfigError, match=r"^model: parameters 1\.weight have requires_grad"):
        Experiment(_config(), model=model, federation=federation)


def test_a_model_changed_after_the_run_started_does_not_resume(tmp_path):
    """The run records the kept weights' hash: resuming with other weights is refused."""
    federation = rotated_digits(n_groups=1, clients_per_group=4, per_client=20)
    model = _model()
    args = {"federation": federation, "rounds": 2, "report": False}
    fedcluster.run(model=model, out=tmp_path / "run", config={"checkpoint_every": 1}, **args)
    with torch.no_grad():
        model[1].weight[0, 0] += 1.0
    with pytest.raises(FedclusterError, match="model passed differs from the run.s"):
        fedcluster.resume(tmp_path / "run", model=model, federation=federation)


class _NaNOut(nn.Module):
    """A model whose predictions are NaN (a broken user model)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1)) * float("nan")


def test_a_model_giving_nan_leaves_empty_cells_and_names_each_client(tmp_path):
    """Every client's training and evaluation is non-finite: each is rejected and named in
    events.csv, and the accuracy and test loss cells are empty, never 0.0."""
    import csv

    federation = rotated_digits(n_groups=1, clients_per_group=4, per_client=20)
    args = {"federation": federation, "rounds": 1, "report": False}
    fedcluster.run(model=_NaNOut(), out=tmp_path / "run", **args)
    with open(tmp_path / "run/metrics.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert row["accuracy"] == "" and row["test_loss"] == "" and row["accuracy_mean"] == ""
    with open(tmp_path / "run/events.csv", newline="") as f:
        events = list(csv.DictReader(f))
    evaluated = {e["client"] for e in events if e["detail"].startswith("evaluat")}
    assert evaluated == {"0", "1", "2", "3"}
    assert all("non-finite" in e["detail"] for e in events if e["kind"] == "rejected")


def _given(**change):
    from dataclasses import replace

    return replace(rotated_digits(n_groups=1, clients_per_group=4, per_client=20), **change)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"n_classes": 0}, "n_classes is 0, not in 1..100000"),
        ({"n_classes": 10**7}, "n_classes is 10000000, not in 1..100000"),
        ("float labels", "train labels are torch.float32, not integers"),
    ],
)
def test_a_python_federation_is_checked_like_a_file(change, named):
    if change == "float labels":
        federation = rotated_digits(n_groups=1, clients_per_group=4, per_client=20)
        change = {"y_train": federation.y_train.float() + 0.5}
    with pytest.raises(DataError, match=named):
        Experiment(_config(), federation=_given(**change))


def test_a_python_federation_s_bad_clients_are_excluded_or_refused():
    """Client 1's labels out of range: excluded (the others renumbered) as a file's would
    be, or the run refused with ``data.bad_clients: refuse``."""
    federation = rotated_digits(n_groups=1, clients_per_group=4, per_client=20)
    y = federation.y_train.clone()
    y[federation.client_slice(1)] = 99
    bad = _given(y_train=y)
    kept = Experiment(_config(), federation=bad).federation(0)
    assert kept.n_clients == 3
    assert torch.equal(kept.y_train[kept.client_slice(1)], y[federation.client_slice(2)])
    refuse = validate_config(
        {**_config().model_dump(mode="json"), "data": {"bad_clients": "refuse"}}
    )
    with pytest.raises(DataError, match=r"client 1: training labels outside 0\.\.9"):
        Experiment(refuse, federation=bad)


def _text_loss(logits, targets):
    return "low"


def _per_sample_loss(logits, targets):
    return nn.functional.cross_entropy(logits, targets, reduction="none")


@pytest.mark.parametrize(
    ("loss", "named"),
    [
        (_text_loss, "_text_loss returned str 'low', not a floating-point tensor of one value"),
        (_per_sample_loss, "_per_sample_loss returned a torch.float32 tensor of shape (20,)"),
    ],
)
def test_a_loss_breaking_its_contract_is_one_line_naming_it(tmp_path, loss, named):
    federation = rotated_digits(n_groups=1, clients_per_group=4, per_client=20)
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        fedcluster.run(
            model=_model(),
            federation=federation,
            rounds=1,
            train={"batch_size": 20},
            loss=loss,
            report=False,
            out=tmp_path / "run",
        )
    assert not (tmp_path / "run").exists()
