"""Run directory, determinism, checkpoints and resume, participation."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fedcluster.config.schema import resolve_config
from fedcluster.experiment.metrics import TIMING_COLUMNS
from fedcluster.experiment.runner import Experiment, resume, select_clients

TINY = [
    "data.dataset=digits",
    "data.partition={name: rotation, n_groups: 2, base: iid, "
    "base_options: {n_clients: 6, test_fraction: 0.2}}",
    "model.options={hidden: [16]}",
    "rounds=6",
    "checkpoint_every=2",
    "algorithms=[{name: fedavg}, {name: jgl, params: {n_clusters: 2}}]",
]


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _without_timing(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_COLUMNS} for r in rows]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("full")
    Experiment(resolve_config(None, "quickstart", TINY)).run(out, progress=False)
    return out


def test_run_directory_contract(uninterrupted):
    files = {p.name for p in uninterrupted.iterdir()}
    assert {
        "config.yaml",
        "metrics.csv",
        "clusters.csv",
        "diagnostics.csv",
        "summary.json",
        "summary.md",
        "checkpoints",
    } <= files
    rows = _rows(uninterrupted / "metrics.csv")
    assert len(rows) == 2 * 6
    assert {r["algorithm"] for r in rows} == {"fedavg", "jgl"}
    clusters = _rows(uninterrupted / "clusters.csv")
    assert len(clusters) == 6 * 6  # jgl only: 6 clients x 6 rounds
    assert set(clusters[0]) == {"algorithm", "seed", "round", "client", "cluster", "true_group"}
    summary = json.loads((uninterrupted / "summary.json").read_text())
    assert [j["algorithm"] for j in summary["jobs"]] == ["fedavg", "jgl"]
    # The resolved config reproduces the run.
    again = resolve_config(uninterrupted / "config.yaml")
    assert again.rounds == 6 and again.seeds == [0]


def test_same_config_and_seed_give_identical_metrics(uninterrupted, tmp_path):
    Experiment(resolve_config(None, "quickstart", TINY)).run(tmp_path, progress=False)
    assert _without_timing(_rows(tmp_path / "metrics.csv")) == _without_timing(
        _rows(uninterrupted / "metrics.csv")
    )
    assert _rows(tmp_path / "clusters.csv") == _rows(uninterrupted / "clusters.csv")


def test_resume_after_stop_equals_uninterrupted_run(uninterrupted, tmp_path):
    config = resolve_config(None, "quickstart", TINY)
    # Stops after round 3 in each job: the checkpoint is at round 2, so round 3 is redone.
    Experiment(config).run(tmp_path, progress=False, stop_after_round=3)
    assert len(_rows(tmp_path / "metrics.csv")) == 2 * 3
    resume(tmp_path, progress=False)
    assert _without_timing(_rows(tmp_path / "metrics.csv")) == _without_timing(
        _rows(uninterrupted / "metrics.csv")
    )
    assert _rows(tmp_path / "clusters.csv") == _rows(uninterrupted / "clusters.csv")


def test_resume_after_sigkill_equals_uninterrupted_run(uninterrupted, tmp_path):
    """A real process killed mid-run, then `fedcluster resume`."""
    args = [sys.executable, "-m", "fedcluster.cli", "run", "--quiet", "--out", str(tmp_path)]
    for s in TINY + ["rounds=6", "checkpoint_every=1"]:
        args += ["--set", s]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "metrics.csv"
    deadline = time.time() + 120
    while time.time() < deadline:
        if metrics.exists() and len(_rows(metrics)) >= 8:  # inside the second job
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(_rows(metrics)) < 12
    done = subprocess.run(
        [sys.executable, "-m", "fedcluster.cli", "resume", "--quiet", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert _without_timing(_rows(metrics)) == _without_timing(_rows(uninterrupted / "metrics.csv"))


def test_partial_participation_draws_count_or_fraction():
    base = resolve_config(None, "quickstart", ["participation.fraction=0.25"])
    sel = select_clients(24, base, seed=0, rnd=3)
    assert len(sel) == 6 and len(set(sel)) == 6
    assert np.array_equal(sel, select_clients(24, base, seed=0, rnd=3))
    assert not np.array_equal(sel, select_clients(24, base, seed=0, rnd=4))
    counted = resolve_config(None, "quickstart", ["participation.count=5"])
    assert len(select_clients(24, counted, seed=0, rnd=1)) == 5


def test_participation_limits_who_trains(tmp_path):
    config = resolve_config(None, "quickstart", TINY + ["participation.count=2", "rounds=1"])
    Experiment(config).run(tmp_path, progress=False)
    rows = _rows(tmp_path / "metrics.csv")
    fedavg = next(r for r in rows if r["algorithm"] == "fedavg")
    full = resolve_config(None, "quickstart", TINY + ["rounds=1"])
    Experiment(full).run(tmp_path / "full", progress=False)
    fedavg_full = next(
        r for r in _rows(tmp_path / "full" / "metrics.csv") if r["algorithm"] == "fedavg"
    )
    assert int(fedavg["bytes_up"]) * 3 == int(fedavg_full["bytes_up"])


def test_algorithm_diagnostics_and_artifacts_are_saved(tmp_path):
    sets = TINY + [
        "data.partition={name: label_combinations, n_combinations: 2, labels_per_combination: 2, "
        "samples_per_label: 40, n_clients: 6, test_fraction: 0.25}",
        "rounds=3",
        "algorithms=[{name: cflgt, params: {pretrain_rounds: 1}}, {name: dcfl}]",
    ]
    Experiment(resolve_config(None, "quickstart", sets)).run(tmp_path, progress=False)
    diag = _rows(tmp_path / "diagnostics.csv")
    names = {(r["algorithm"], r["name"]) for r in diag}
    assert ("dcfl", "dunn") in names and ("cflgt", "hopkins") in names
    arrays = np.load(tmp_path / "artifacts" / "cflgt-seed0.npz")
    assert arrays["trajectories"].shape == (6, 10, 2)
