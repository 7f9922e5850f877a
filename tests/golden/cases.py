"""Golden runs: the run-directory tables of fixed configs, stored before a refactor.

Each case is a config (a preset or a YAML file in ``configs/``) whose
``metrics.csv`` (timing columns dropped), ``clusters.csv``, ``events.csv``
and ``diagnostics.csv`` are kept under ``tests/golden/<case>/``. A refactor
that claims to keep every number must reproduce them byte for byte
(``test_golden.py``).

Float results depend on the CPU's kernels (MKL and oneDNN pick code paths by
instruction set and vendor), so the files are only comparable on a machine
with the fingerprint stored beside them (``machine.json``); elsewhere the test
skips and says so. Regenerate on purpose only, after a change that is meant
to move numbers::

    python -m tests.golden.cases [CASE ...]   # with FEDCLUSTER_DATA set for cflgt-s1
"""

from __future__ import annotations

import csv
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from fedcluster.config.schema import resolve_config
from fedcluster.experiment.metrics import TIMING_COLUMNS
from fedcluster.experiment.runner import Experiment

HERE = Path(__file__).resolve().parent
TABLES = ("metrics.csv", "clusters.csv", "events.csv", "diagnostics.csv")

# case -> (preset, config file, --set overrides, needs the shared datasets)
CASES: dict[str, tuple[str | None, str | None, list[str], bool]] = {
    "quickstart": (None, "main-job.yaml", [], False),
    "dp-client": (None, "dp-client.yaml", [], False),
    "dp-record": (None, "dp-record.yaml", [], False),
    "dynamic": (None, "dynamic.yaml", [], False),
    "cflgt-s1": ("cflgt-s1", None, ["rounds=30"], True),
}


def machine() -> dict[str, str]:
    """What decides float results: torch's build, its CPU code path, the CPU vendor."""
    vendor = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("vendor_id"):
                vendor = line.split(":", 1)[1].strip()
                break
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "vendor": vendor or platform.processor(),
    }


def run_case(case: str, out: Path, data_dir: str | None = None) -> Path:
    """Run one golden case into ``out`` (one torch thread, as in the test suite)."""
    preset, config_file, sets, _ = CASES[case]
    path = None if config_file is None else str(HERE / "configs" / config_file)
    overrides = {"data": {"data_dir": data_dir}} if data_dir else None
    config = resolve_config(path, preset, sets, overrides)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Experiment(config).run(out, progress=False)
    finally:
        torch.set_num_threads(threads)
    return out


def table(path: Path) -> list[list[str]]:
    """A run table's rows as strings, timing columns dropped."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = rows[0]
    keep = [i for i, name in enumerate(header) if name not in TIMING_COLUMNS]
    return [[row[i] for i in keep] for row in rows]


def write_golden(case: str, run: Path) -> None:
    """Store a run's tables (timing columns dropped) and this machine's fingerprint."""
    dest = HERE / case
    dest.mkdir(exist_ok=True)
    for name in TABLES:
        with open(dest / name, "w", newline="") as f:
            csv.writer(f, lineterminator="\n").writerows(table(run / name))
    (dest / "machine.json").write_text(json.dumps(machine(), indent=2) + "\n")


def main(cases: list[str]) -> None:
    data_dir = os.environ.get("FEDCLUSTER_DATA")
    for case in cases or list(CASES):
        with tempfile.TemporaryDirectory() as tmp:
            write_golden(case, run_case(case, Path(tmp) / case, data_dir))
        print(f"golden {case}: written to {HERE / case}")
    shutil.rmtree(HERE / "__pycache__", ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
