"""Jobs in parallel (fedcluster.experiment.jobs): the run directory equals a sequential run's, and a
parallel run stopped part-way resumes to the same tables."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from fedcluster.cli import main
from fedcluster.config.schema import dump_config, validate_config, with_execution
from fedcluster.errors import ConfigError
from fedcluster.experiment.metrics import TIMING_COLUMNS
from fedcluster.experiment.runner import Experiment
from tests.helpers import digits_config

TABLES = ("metrics.csv", "clusters.csv", "events.csv", "diagnostics.csv", "clients.csv")


def _config(jobs: int = 1) -> dict:
    algorithms = [{"name": "fedavg"}, {"name": "ifca", "params": {"n_clusters": "auto"}}]
    config = digits_config("jobs", 3, algorithms)
    return {**config, "seeds": [0, 1], "jobs": jobs}


def _table(path: Path) -> list[list[str]]:
    """A table's lines with its timing columns blanked (they measure this machine)."""
    rows = list(csv.reader(io.StringIO(path.read_text(), newline="")))
    timing = [i for i, name in enumerate(rows[0]) if name in TIMING_COLUMNS]
    return [[("" if i in timing else v) for i, v in enumerate(r)] for r in rows]


def _summary(path: Path) -> list[dict]:
    jobs = json.loads((path / "summary.json").read_text())["jobs"]
    return [{k: v for k, v in job.items() if k != "wall_seconds"} for job in jobs]


@pytest.fixture(scope="module")
def sequential(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("jobs") / "sequential"
    Experiment(validate_config(_config())).run(out, progress=False)
    return out


def _same_directory(a: Path, b: Path) -> None:
    for name in TABLES:
        assert _table(a / name) == _table(b / name), name
    assert (a / "config.yaml").read_bytes() == (b / "config.yaml").read_bytes()
    assert (a / "select_k.csv").read_bytes() == (b / "select_k.csv").read_bytes()
    assert _summary(a) == _summary(b)
    assert sorted(p.name for p in (a / "checkpoints").iterdir()) == sorted(
        p.name for p in (b / "checkpoints").iterdir()
    )


def test_two_jobs_at_once_write_the_sequential_run_directory(sequential, tmp_path):
    out = tmp_path / "parallel"
    results = Experiment(validate_config(_config(jobs=2))).run(out, progress=False)
    assert [(r.algorithm, r.seed) for r in results] == [
        ("fedavg", 0),
        ("ifca", 0),
        ("fedavg", 1),
        ("ifca", 1),
    ]
    _same_directory(sequential, out)


def test_a_parallel_run_stopped_part_way_resumes_to_the_sequential_tables(sequential, tmp_path):
    out = tmp_path / "cut"
    Experiment(validate_config(_config(jobs=2))).run(out, progress=False, stop_after_round=2)
    assert {int(r[0]) for r in _table(out / "metrics.csv")[1:]} == {1, 2}
    assert main(["resume", str(out), "--jobs", "2", "--quiet", "--no-report"]) == 0
    _same_directory(sequential, out)


def test_execution_fields_stay_out_of_config_yaml():
    """jobs, backend, workers, address change no number: config.yaml (and the digest
    binding checkpoints to it) is the same whatever they are."""
    plain = validate_config(_config())
    other = with_execution(plain, jobs=3, backend="distributed", workers=4, address="h:1")
    assert (other.jobs, other.backend, other.workers, other.address) == (3, "distributed", 4, "h:1")
    assert dump_config(other) == dump_config(plain)
    with pytest.raises(ConfigError, match="jobs"):
        with_execution(plain, jobs=0)


def test_parallel_jobs_refuse_objects_that_cannot_reach_a_worker(tmp_path):
    """A callback that cannot be pickled is refused in one line naming it."""
    from fedcluster.experiment.callbacks import Callback

    class Local(Callback):  # defined in a function: pickle cannot name it
        pass

    experiment = Experiment(validate_config(_config(jobs=2)), callbacks=[Local()])
    with pytest.raises(ConfigError, match="callbacks passed from Python cannot be sent"):
        experiment.run(tmp_path / "refused", progress=False)
    assert not (tmp_path / "refused").exists()
