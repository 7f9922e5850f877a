"""Shared helpers of the benchmarks: the data root, the device option, saving a run's JSON;
running presets over seeds and summarising come from :mod:`fedcluster.reproduce`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from fedcluster.engine.device import DEVICES
from fedcluster.reproduce import parser as reproduce_parser
from fedcluster.reproduce import save_json

REPO = Path(__file__).resolve().parents[1]


def default_data_dir() -> str:
    """``$FEDCLUSTER_DATA`` or ``../shared/data`` beside the repository."""
    return os.environ.get("FEDCLUSTER_DATA", str(REPO.parent / "shared" / "data"))


def add_device_argument(p: argparse.ArgumentParser) -> None:
    """``--device cpu|cuda|auto``: where the simulator and the plain loop run."""
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="run the simulator and the plain loop here (cuda: a GPU; auto: cuda if visible)",
    )


def synchronize() -> None:
    """Wait for queued GPU work (nothing on a CPU), so that a timer brackets it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def parser(description: str) -> argparse.ArgumentParser:
    """:func:`fedcluster.reproduce.parser` with this checkout's data root as default."""
    p = reproduce_parser(description)
    p.set_defaults(data_dir=default_data_dir())
    return p


def save_run(path: str | None, results: object, load_before: tuple, **extra: object) -> None:
    """With a ``path``: ``results`` as JSON beside the machine (``lscpu``), the load
    averages before and now, and ``extra`` fields."""
    if not path:
        return
    from benchmarks.performance.bench_round import machine_info

    payload = {
        "machine": machine_info(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        **extra,
        "results": results,
    }
    save_json(Path(path), payload)
