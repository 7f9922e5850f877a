"""A server state's checkpoint record: rebuilt exactly, and a record written by an older
fedcluster (a state field since removed or added) is one line naming the field."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from fedcluster.algorithms.cluster_models import ClusterModelState
from fedcluster.algorithms.dcfl import DCFLState
from fedcluster.config.schema import resolve_config
from fedcluster.errors import FedclusterError
from fedcluster.experiment.rundir import RunDirectory
from fedcluster.experiment.runner import Experiment, resume
from fedcluster.experiment.tensor_digest import digests

SETS = [
    "rounds=3",
    "checkpoint_every=1",
    "data.partition.base_options.n_clients=6",
    "model.options.hidden=[8]",
    "algorithms=[{name: ifca, params: {n_clusters: 2}}]",
]


def _dcfl_state() -> DCFLState:
    return DCFLState(
        models=torch.arange(6.0).reshape(2, 3),
        assign=np.array([0, 1, -1]),
        reclusterings=2,
        directions=torch.ones(2, 3),
        direction_noise=torch.tensor([0.5, 0.0], dtype=torch.float64),
    )


def test_a_record_rebuilds_the_state():
    state = _dcfl_state()
    again = DCFLState.from_record(state.to_record())
    assert torch.equal(again.models, state.models)
    assert np.array_equal(again.assign, state.assign) and again.reclusterings == 2
    assert torch.equal(again.directions, state.directions)
    assert torch.equal(again.direction_noise, state.direction_noise)


def test_a_removed_field_is_named():
    record = _dcfl_state().to_record()
    record["fields"]["dunn"] = 1.5  # DCFL once kept its Dunn index in the state
    with pytest.raises(ValueError, match="older fedcluster: state field 'dunn' is no longer"):
        DCFLState.from_record(record)


def test_a_missing_field_is_named():
    record = _dcfl_state().to_record()
    del record["fields"]["reclusterings"]
    with pytest.raises(ValueError, match="state field 'reclusterings' of a DCFLState is missing"):
        DCFLState.from_record(record)


def test_resuming_an_older_checkpoint_is_one_line_and_keeps_the_run(tmp_path):
    out = tmp_path / "run"
    Experiment(resolve_config(None, "quickstart", SETS)).run(
        out, progress=False, stop_after_round=2
    )
    path = RunDirectory(out).checkpoint_path("ifca", 0)
    raw = torch.load(io.BytesIO(path.read_bytes()), weights_only=True)
    assert raw["state"]["type"] == ClusterModelState.__name__
    raw["state"]["fields"]["repair_splits"] = 0  # a field the state had before
    meta = json.loads(raw["meta"])  # as that version wrote it: digests of what it stored
    meta["sha256"] = digests({"state": raw["state"], "clusters": raw["clusters"]})
    raw["meta"] = json.dumps(meta)
    buffer = io.BytesIO()
    torch.save(raw, buffer)
    path.write_bytes(buffer.getvalue())
    metrics = (out / "metrics.csv").read_bytes()
    with pytest.raises(FedclusterError) as caught:
        resume(out, progress=False)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    assert "checkpoint written by an older fedcluster: state field 'repair_splits'" in message
    assert message.endswith("delete it to restart that job from round 1")
    assert (out / "metrics.csv").read_bytes() == metrics  # nothing already written is lost
