"""backend: distributed (fedcluster.experiment.distributed): clients sharded over two
torch.distributed (gloo, 127.0.0.1) worker processes give the one-process simulator's
metrics and clusters, for the built-in methods and a computation defined outside src/;
a worker killed mid-run leaves a run that completes with the same numbers and resumes."""

from __future__ import annotations

import csv
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import tests.algorithms.test_custom_computation  # noqa: F401  (registers test-label-split)
from fedcluster.cli import main
from fedcluster.config.schema import validate_config
from fedcluster.errors import ConfigError
from fedcluster.experiment.callbacks import Callback
from fedcluster.experiment.distributed import shard_clients
from fedcluster.experiment.metrics import TIMING_COLUMNS
from fedcluster.experiment.runner import Experiment
from tests.helpers import digits_config

ALGORITHMS = [
    {"name": "fedavg"},
    {"name": "ifca", "params": {"n_clusters": 2}},
    {"name": "jgl"},
    {"name": "cflgt"},
    {"name": "dcfl"},
    {"name": "fedgroup", "params": {"n_groups": 2, "pretrain_scale": 1}},
    {"name": "test-label-split"},
]


def _config(algorithms: list[dict], backend: str = "simulator") -> dict:
    """7 digits clients, 3 rounds, 75% participation. ``group_size: 1``: the MLP kernel
    trains each client alone, so a client's arithmetic has the same shapes wherever it
    runs and the numbers are equal bit for bit on any CPU (in groups, a client's float
    rounding depends on its group mates' batch shapes: docs/scale-out.md)."""
    config = digits_config("distributed", 3, algorithms)
    config["data"]["partition"] = {"name": "dirichlet", "n_clients": 7, "alpha": 0.5}
    config["data"]["partition"]["test_fraction"] = 0.2
    return {
        **config,
        "participation": {"fraction": 0.75},
        "group_size": 1,
        "backend": backend,
        "workers": 2,
    }


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return [{k: v for k, v in r.items() if k not in TIMING_COLUMNS} for r in csv.DictReader(f)]


def _same_numbers(a: Path, b: Path) -> None:
    for table in ("metrics.csv", "clusters.csv"):
        assert _rows(a / table) == _rows(b / table), table


def test_shards_are_balanced_greedily_largest_first():
    sizes = np.array([5, 9, 2, 7, 7, 1])
    shards = shard_clients(sizes, 2)
    # by hand: 9 -> w0, 7 (client 3) -> w1, 7 (client 4) -> w1 (7 < 9), 5 -> w0 (9 < 14),
    # 2 -> w1 (14 = 14: lowest rank... w0 has 14, w1 has 14) -> w0, 1 -> w1
    assert [s.tolist() for s in shards] == [[0, 1, 2], [3, 4, 5]]
    assert [int(sizes[s].sum()) for s in shards] == [16, 15]
    many = shard_clients(np.arange(1, 41), 3)
    assert sorted(np.concatenate(many).tolist()) == list(range(40))
    loads = [int((s + 1).sum()) for s in many]
    assert max(loads) - min(loads) <= 40  # greedy largest-first: within the largest client


@pytest.mark.slow
def test_two_workers_give_the_simulator_s_numbers(tmp_path):
    Experiment(validate_config(_config(ALGORITHMS))).run(tmp_path / "one", progress=False)
    config = validate_config(_config(ALGORITHMS, "distributed"))
    Experiment(config).run(tmp_path / "two", progress=False)
    _same_numbers(tmp_path / "one", tmp_path / "two")
    assert {r["algorithm"] for r in _rows(tmp_path / "two" / "metrics.csv")} == {
        a["name"] for a in ALGORITHMS
    }


class KillWorker(Callback):
    """Kill the first worker process after round 1 (as an out-of-memory kill would)."""

    def __init__(self, experiment: Experiment) -> None:
        self.experiment = experiment

    def on_round_end(self, job, rnd, row, state):
        group = self.experiment.backend_factory.group
        if rnd == 1 and group.processes[0].is_alive():
            group.processes[0].kill()
            group.processes[0].join()


@pytest.mark.slow
def test_a_killed_worker_s_clients_move_and_the_run_resumes_to_the_same_numbers(tmp_path):
    algorithms = [{"name": "ifca", "params": {"n_clusters": 2}}]
    Experiment(validate_config(_config(algorithms))).run(tmp_path / "one", progress=False)
    experiment = Experiment(validate_config(_config(algorithms, "distributed")))
    experiment.callbacks.append(KillWorker(experiment))
    experiment.run(tmp_path / "cut", progress=False, stop_after_round=2)
    moved = [r for r in _rows(tmp_path / "cut" / "events.csv") if r["kind"] == "moved"]
    assert moved and {r["round"] for r in moved} == {"2"}
    assert all("worker 1 lost" in r["detail"] for r in moved)
    assert main(["resume", str(tmp_path / "cut"), "--backend", "distributed", "--quiet"]) == 0
    _same_numbers(tmp_path / "one", tmp_path / "cut")


@pytest.mark.slow
def test_under_torchrun_rank_0_drives_and_the_other_ranks_serve(tmp_path):
    """`torchrun --nproc-per-node 3 -m fedcluster run ... --backend distributed`: the
    command of docs/scale-out.md, on loopback."""
    config = _config([{"name": "fedavg"}, {"name": "ifca", "params": {"n_clusters": 2}}])
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    Experiment(validate_config(config)).run(tmp_path / "one", progress=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3"]
    command += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    command += ["-m", "fedcluster", "run", str(tmp_path / "run.yaml"), "--backend"]
    command += ["distributed", "--out", str(tmp_path / "torchrun"), "--quiet", "--no-report"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    _same_numbers(tmp_path / "one", tmp_path / "torchrun")


def test_a_bad_address_is_one_line_and_leaves_no_run_directory(tmp_path):
    config = validate_config({**_config([{"name": "fedavg"}], "distributed"), "address": "node0"})
    with pytest.raises(ConfigError, match="address: 'node0' is not HOST:PORT"):
        Experiment(config).run(tmp_path / "bad", progress=False)
    assert not (tmp_path / "bad").exists()
