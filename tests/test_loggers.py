"""Loggers as round-loop callbacks: TensorBoard scalars equal metrics.csv; custom callbacks."""

from __future__ import annotations

import csv
import math

import pytest

from fedcluster.config.schema import validate_config
from fedcluster.experiment.callbacks import Callback
from fedcluster.experiment.runner import Experiment
from tests.helpers import digits_config

_CONFIG = digits_config(
    "log", rounds=3, algorithms=[{"name": "fedavg"}, {"name": "ifca", "params": {"n_clusters": 2}}]
)


def _metrics(path) -> dict[tuple[str, int], dict[str, str]]:
    with open(path / "metrics.csv") as f:
        return {(r["algorithm"], int(r["round"])): r for r in csv.DictReader(f)}


class Recorder(Callback):
    def __init__(self) -> None:
        self.calls = []

    def on_round_end(self, job, rnd, row, state):
        self.calls.append((job.label, job.seed, rnd, row["accuracy"], job.run.path))


def test_callbacks_see_every_round_row(tmp_path):
    recorder = Recorder()
    Experiment(validate_config(_CONFIG), callbacks=[recorder]).run(tmp_path, progress=False)
    metrics = _metrics(tmp_path)
    assert [(c[0], c[2]) for c in recorder.calls] == list(metrics)
    for label, seed, rnd, acc, path in recorder.calls:
        assert seed == 0 and path == tmp_path
        assert math.isclose(acc, float(metrics[(label, rnd)]["accuracy"]), rel_tol=0, abs_tol=0)


def test_tensorboard_logger_writes_the_metrics(tmp_path):
    pytest.importorskip("tensorboard", reason="optional extra fedcluster[tensorboard]")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fedcluster.experiment.loggers import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path / "tb")
    Experiment(validate_config(_CONFIG), callbacks=[logger]).run(tmp_path / "run", progress=False)
    logger.close()
    metrics = _metrics(tmp_path / "run")
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["fedavg-seed0", "ifca-seed0"]
    for label in ("fedavg", "ifca"):
        events = EventAccumulator(str(tmp_path / "tb" / f"{label}-seed0"))
        events.Reload()
        tags = set(events.Tags()["scalars"])
        assert {"accuracy", "loss", "bytes_up"} <= tags and "seed" not in tags
        assert ("n_clusters" in tags) == (label == "ifca")  # NaN columns are left out
        got = [(e.step, e.value) for e in events.Scalars("accuracy")]
        expect = [(r, float(metrics[(label, r)]["accuracy"])) for r in (1, 2, 3)]
        assert [s for s, _ in got] == [1, 2, 3]
        assert all(
            math.isclose(g, e, rel_tol=1e-6) for (_, g), (_, e) in zip(got, expect, strict=True)
        )
