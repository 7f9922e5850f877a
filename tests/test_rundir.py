"""A run directory is safe to share and repairable: no code runs from a checkpoint, one
writer at a time, and resume restores edited or truncated tables from the checkpoints."""

from __future__ import annotations

import csv
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedcluster.config.schema import resolve_config
from fedcluster.errors import FedclusterError
from fedcluster.experiment.metrics import TIMING_COLUMNS
from fedcluster.experiment.rundir import RunDirectory, load_checkpoint
from fedcluster.experiment.runner import Experiment, resume

SETS = [
    "rounds=4",
    "checkpoint_every=2",
    "data.partition.base_options.n_clients=8",
    "model.options.hidden=[16]",
    "algorithms=[{name: fedavg}, {name: ifca, params: {n_clusters: 2}}]",
    "scenario.failure_rate=0.2",
]


def _config():
    return resolve_config(None, "quickstart", SETS)


def _table(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    keep = [i for i, name in enumerate(rows[0]) if name not in TIMING_COLUMNS]
    return [[r[i] for i in keep] for r in rows]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "full"
    Experiment(_config()).run(out, progress=False)
    return out


class _Exploit:
    """Unpickling this runs a command: what a crafted checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_malicious_checkpoint_runs_nothing(tmp_path):
    out = tmp_path / "run"
    Experiment(_config()).run(out, progress=False, stop_after_round=2)
    marker = tmp_path / "pwned"
    ckpt = RunDirectory(out).checkpoint_path("fedavg", 0)
    with open(ckpt, "wb") as f:
        pickle.dump({"meta": _Exploit(marker), "state": {}}, f)
    torch.save({"meta": _Exploit(marker)}, RunDirectory(out).checkpoint_path("ifca", 0))
    with pytest.raises(FedclusterError, match="cannot be read safely"):
        resume(out, progress=False)
    assert not marker.exists()


def test_truncated_and_foreign_checkpoints_are_named(tmp_path):
    out = tmp_path / "run"
    Experiment(_config()).run(out, progress=False, stop_after_round=2)
    ckpt = RunDirectory(out).checkpoint_path("fedavg", 0)
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2])
    with pytest.raises(FedclusterError, match=str(ckpt)):
        load_checkpoint(ckpt)
    ckpt.write_bytes(b"")
    with pytest.raises(FedclusterError, match="cannot be read safely"):
        resume(out, progress=False)


def test_a_second_writer_is_refused_with_the_holders_pid(tmp_path):
    out = tmp_path / "run"
    rundir = RunDirectory(out)
    code = (
        "import sys, time\n"
        "from fedcluster.experiment.rundir import RunDirectory\n"
        f"with RunDirectory({str(out)!r}).claim():\n"
        "    print('locked', flush=True)\n"
        "    time.sleep(30)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(FedclusterError, match=f"in use by process {holder.pid}"):
            Experiment(_config()).run(out, progress=False)
    finally:
        holder.kill()
        holder.wait()
    with rundir.lock():  # the dead holder's lock file is taken over
        assert (out / ".lock").read_text().strip() == str(os.getpid())


def test_resume_rebuilds_edited_and_truncated_tables_from_the_checkpoints(finished, tmp_path):
    out = tmp_path / "run"
    Experiment(_config()).run(out, progress=False, stop_after_round=2)
    rundir = RunDirectory(out)
    # A user's edits: metrics cut to its header, an accuracy changed in clusters' stead,
    # events deleted, a garbage line in diagnostics.
    with open(rundir.metrics) as f:
        header = f.readline()
    rundir.metrics.write_text(header)
    lines = rundir.clusters.read_text().splitlines()
    lines[1] = lines[1].rsplit(",", 2)[0] + ",9,0"
    rundir.clusters.write_text("\n".join(lines) + "\n")
    rundir.events.unlink()
    with open(rundir.diagnostics, "a") as f:
        f.write("garbage,line\n")
    resume(out, progress=False)
    for name in ("metrics.csv", "clusters.csv", "events.csv", "diagnostics.csv"):
        assert _table(out / name) == _table(finished / name), name


def test_resume_after_a_completed_run_changes_nothing(finished, tmp_path):
    out = tmp_path / "run"
    Experiment(_config()).run(out, progress=False)
    before = {p.name: _table(p) for p, _ in RunDirectory(out).tables()}
    resume(out, progress=False)
    after = {p.name: _table(p) for p, _ in RunDirectory(out).tables()}
    assert before == after
