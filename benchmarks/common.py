"""Shared helpers of the reproduction benchmarks: run presets over seeds, summarise."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import numpy as np
import torch

from fedcluster.config import resolve_config
from fedcluster.engine.device import DEVICES
from fedcluster.rundir import job_summary
from fedcluster.runner import Experiment

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
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--first-seed", type=int, default=0, help="seeds first .. first + seeds - 1")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--data-dir", default=default_data_dir())
    p.add_argument("--out", default="runs/benchmarks")
    return p


def run_setting(
    preset: str | None,
    sets: list[str],
    seeds: int,
    out: Path,
    data_dir: str,
    rounds: int | None = None,
    first_seed: int = 0,
    config_path: str | None = None,
    only: list[str] | None = None,
) -> list[dict]:
    """Run a preset (and/or a config file) with overrides for ``seeds`` seeds; job summaries.

    ``only`` keeps the algorithms of those labels or names, after ``sets`` (``--algorithms``).
    """
    overrides = {
        "seeds": list(range(first_seed, first_seed + seeds)),
        "data": {"data_dir": data_dir},
    }
    if rounds is not None:
        overrides["rounds"] = rounds
    config = resolve_config(config_path, preset, sets, overrides)
    if only:
        keep = [a for a in config.algorithms if a.label in only or a.name in only]
        missing = set(only) - {a.label for a in keep} - {a.name for a in keep}
        if missing:
            raise SystemExit(f"--algorithms: no algorithm labelled or named {sorted(missing)}")
        config = config.model_copy(update={"algorithms": keep})
    results = Experiment(config).run(out, progress=False)
    summaries = [job_summary(j) for j in results]
    for s, j in zip(summaries, results, strict=True):
        s["rows"] = j.rows
    return summaries


def mean_std(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    vals = [v * scale for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return "-"
    return f"{np.mean(vals):.{digits}f} ± {np.std(vals):.{digits}f}"


def save_json(path: Path, payload: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=float))


def save_run(path: str | None, results: object, load_before: tuple, **extra: object) -> None:
    """With a ``path``: ``results`` as JSON beside the machine (``lscpu``), the load
    averages before and now, and ``extra`` fields."""
    if not path:
        return
    from benchmarks.bench_round import machine_info

    payload = {
        "machine": machine_info(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        **extra,
        "results": results,
    }
    save_json(Path(path), payload)
