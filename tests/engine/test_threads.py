"""Worker threads under load: sized to the free CPUs, results unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from fedcluster.algorithms.base import init_row
from fedcluster.data.federation import Federation
from fedcluster.engine import threads
from fedcluster.engine.reference import reference_train
from fedcluster.engine.simulator import Simulator
from fedcluster.models import build_model
from fedcluster.protocol.batches import LocalTraining


def test_omp_wait_policy_is_passive_in_the_cli_unless_the_user_chose_one():
    # `import fedcluster` leaves the environment alone; the command's entry point sets it
    code = (
        "import os, fedcluster; a = os.environ.get('OMP_WAIT_POLICY')\n"
        "from fedcluster import cli\n"
        "try:\n    cli.main(['list', 'presets'])\nexcept SystemExit:\n    pass\n"
        "print(a, os.environ['OMP_WAIT_POLICY'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    run = [sys.executable, "-c", code]
    out = subprocess.run(run, env=env, capture_output=True, text=True).stdout.split()[-2:]
    assert out == ["None", "PASSIVE"]
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    out = subprocess.run(run, env=env, capture_output=True, text=True).stdout.split()[-2:]
    assert out == ["ACTIVE", "ACTIVE"]


def test_available_cpus_is_the_affinity_mask():
    assert threads.available_cpus() == len(os.sched_getaffinity(0))


def test_busy_cpu_seconds_sum_the_affinity_cpus_of_proc_stat(tmp_path):
    tick = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal
    stat.write_text(
        "cpu  9 9 9 9 9 9 9 9\n"
        "cpu0 100 0 50 400 7 1 2 3\n"
        "cpu1 10 5 0 900 0 0 0 0\n"
        "cpu2 1000 0 0 0 0 0 0 0\n"
        "intr 1 2 3\n"
    )
    assert threads._read_busy({0, 1}, str(stat)) == pytest.approx((156 + 15) / tick)
    assert threads._read_busy(None, str(stat)) == pytest.approx((156 + 15 + 1000) / tick)
    assert threads._read_busy({0}, str(tmp_path / "missing")) is None


class _Fixed:
    def __init__(self, busy: float) -> None:
        self.busy = busy

    def busy_elsewhere(self) -> float:
        return self.busy


@pytest.mark.parametrize(
    "cpus,busy,requested,expected",
    [
        (2, 0.0, 2, 2),
        (2, 1.0, 2, 1),
        (2, 1.9, 2, 1),
        (4, 1.2, 8, 3),
        (4, 0.0, 1, 1),
        (2, 0.0, 8, 2),
        (2, 5.0, 2, 1),
    ],
)
def test_usable_workers_leave_the_busy_cpus_alone(monkeypatch, cpus, busy, requested, expected):
    monkeypatch.setattr(threads, "available_cpus", lambda: cpus)
    assert threads.usable_workers(requested, _Fixed(busy)) == expected  # type: ignore[arg-type]


def test_a_competing_process_is_seen_as_busy_elsewhere():
    monitor = threads.LoadMonitor()
    cpus = sorted(os.sched_getaffinity(0))
    spin = subprocess.Popen(
        ["taskset", "-c", str(cpus[0]), sys.executable, "-c", "while True: pass"]
        if _has_taskset()
        else [sys.executable, "-c", "while True: pass"]
    )
    try:
        time.sleep(0.3)
        monitor.busy_elsewhere()  # starts the window while the competitor runs
        time.sleep(0.5)
        assert monitor.busy_elsewhere() >= 0.5
    finally:
        spin.kill()
        spin.wait()


def _has_taskset() -> bool:
    return subprocess.run(["which", "taskset"], capture_output=True).returncode == 0


@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
def test_results_do_not_depend_on_how_many_workers_the_load_allows(monkeypatch, model_name):
    """The kernel's groups and the autograd path's clients run on 1 or 2 workers: same bits."""
    gen = torch.Generator().manual_seed(0)
    sizes = [30, 45, 20, 37, 25, 41]
    train = [(torch.rand(n, 1, 12, 12, generator=gen), torch.arange(n) % 10) for n in sizes]
    fed = Federation.from_clients(train, [(x[:5], y[:5]) for x, y in train], 10)
    model = build_model(model_name, fed.input_shape, 10)
    cfg = LocalTraining(lr=0.1, batch_size=8, epochs=1)
    clients = np.arange(len(sizes))
    start = init_row(model, 0, "test")
    rows = {}
    for allowed in (1, 2):

        def allow(n: int, a: int = allowed, adaptive: bool = True) -> int:
            return min(n, a)

        monkeypatch.setattr(threads, "usable_workers", allow)
        sim = Simulator(model, fed, seed=5, group_size=2, threads=2)
        rows[allowed] = sim.train(clients, start, cfg, rnd=1)
    assert torch.equal(rows[1].rows, rows[2].rows) and torch.equal(rows[1].loss, rows[2].loss)
    plain = reference_train(model, fed, clients, start, cfg, seed=5, rnd=1)
    # 2 steps of lr 0.1 from parameters below 1: float32 rounding of the two orders of
    # summation stays far below 1e-5 (the simulator's tolerance against the loop).
    assert (rows[2].rows - plain).abs().max().item() <= 1e-5
    assert torch.get_num_threads() == 1


def test_an_explicit_thread_count_is_capped_by_the_affinity_mask_only(monkeypatch):
    monkeypatch.setattr(threads, "available_cpus", lambda: 2)
    assert threads.usable_workers(4, _Fixed(2.0), adaptive=False) == 2  # type: ignore[arg-type]
    assert threads.usable_workers(4, _Fixed(2.0)) == 1  # type: ignore[arg-type]
