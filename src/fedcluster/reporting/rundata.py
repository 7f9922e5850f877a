"""Reading a run directory back for the report (DESIGN "Run directory").

Only the files a run writes are read (``config.yaml``, ``metrics.csv``,
``clusters.csv``, ``events.csv``, ``diagnostics.csv``, ``select_k.csv``, ``summary.json``,
and ``assign.csv`` where ``fedcluster assign --record`` wrote one; see
:class:`fedcluster.experiment.runner.RunDirectory` and :mod:`fedcluster.experiment.metrics` for the
columns), so a report can be made of a run copied from another machine,
without its data or the package version that wrote it.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedcluster.config import safeyaml
from fedcluster.errors import FedclusterError


def _float(text: str) -> float:
    return float(text) if text not in ("", None) else math.nan


@dataclass
class Series:
    """One metric of one job, by round: ``rounds`` and ``values`` (NaN where empty)."""

    rounds: np.ndarray
    values: np.ndarray


@dataclass
class RunData:
    """The files of one run directory, parsed.

    ``metrics`` maps (label, seed) to column -> array over that job's rounds
    (``round`` included); ``labels`` keeps the algorithms in run order.
    """

    path: Path
    name: str
    config: dict
    config_text: str
    labels: list[str]
    seeds: list[int]
    metrics: dict[tuple[str, int], dict[str, np.ndarray]]
    clusters: dict[tuple[str, int], dict[str, np.ndarray]] = field(default_factory=dict)
    events: list[dict[str, str]] = field(default_factory=list)
    diagnostics: dict[tuple[str, int, str], Series] = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    select_k: list[dict[str, str]] = field(default_factory=list)
    """``select_k.csv``: the criterion per K of each ``n_clusters: auto`` job."""
    assign: list[dict[str, str]] = field(default_factory=list)
    """``assign.csv``: test-time cluster choices recorded by ``fedcluster assign --record``."""

    def column(self, label: str, column: str) -> tuple[np.ndarray, np.ndarray]:
        """``(rounds, values[seed, round])`` of one algorithm's column over its seeds.

        Seeds with fewer rounds (a stopped job) are padded with NaN.
        """
        jobs = [self.metrics[(label, s)] for s in self.seeds if (label, s) in self.metrics]
        rounds = np.unique(np.concatenate([j["round"] for j in jobs]))
        out = np.full((len(jobs), len(rounds)), np.nan)
        for i, job in enumerate(jobs):
            out[i, np.searchsorted(rounds, job["round"])] = job[column]
        return rounds, out

    def has_column(self, column: str) -> bool:
        """Whether any job has a non-empty value in ``column``."""
        return any(np.isfinite(job[column]).any() for job in self.metrics.values())

    @property
    def private(self) -> bool:
        """Local differential privacy was on (``privacy.mode`` other than ``none``)."""
        return (self.config.get("privacy") or {}).get("mode", "none") != "none"


def _read_csv(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def load_run(path: str | Path) -> RunData:
    """Parse a run directory; a clear error when it is not one or has no finished round.

    A damaged or hand-edited directory (a row with a missing column, a seed that is
    not a number, a config that is not a mapping, binary garbage) is one
    :class:`FedclusterError` naming the directory, never a traceback.
    """
    with readable(path):
        return _load_run(Path(path))


@contextmanager
def readable(what: str | Path) -> Iterator[None]:
    """Turn what malformed run files raise while being read into one line naming ``what``."""
    try:
        yield
    except FedclusterError:
        raise
    except (OSError, UnicodeDecodeError, csv.Error, ValueError, KeyError, TypeError, IndexError,
            AttributeError, RecursionError) as exc:  # fmt: skip
        reason = " ".join(str(exc).split())[:200]
        raise FedclusterError(
            f"{what}: not a readable run directory ({type(exc).__name__}: {reason})"
        ) from None


def _load_run(path: Path) -> RunData:
    config_file, metrics_file = path / "config.yaml", path / "metrics.csv"
    for required in (config_file, metrics_file):
        if not required.is_file():
            raise FedclusterError(f"{path} is not a run directory (no {required.name})")
    config_text = safeyaml.read_text(config_file, "config file")
    config = safeyaml.loads(config_text, str(config_file)) or {}
    if not isinstance(config, dict):
        raise FedclusterError(f"{config_file}: top level is not a mapping of fields")
    rows = _read_csv(metrics_file)
    if not rows:
        raise FedclusterError(f"{metrics_file}: no rounds yet; nothing to report")
    labels: list[str] = []
    seeds: list[int] = []
    grouped: dict[tuple[str, int], list[dict[str, str]]] = {}
    for r in rows:
        key = (r["algorithm"], int(r["seed"]))
        grouped.setdefault(key, []).append(r)
        if key[0] not in labels:
            labels.append(key[0])
        if key[1] not in seeds:
            seeds.append(key[1])
    metrics = {}
    for key, job in grouped.items():
        cols = {c: np.array([_float(r[c]) for r in job]) for c in job[0] if c != "algorithm"}
        cols["round"] = cols["round"].astype(int)
        metrics[key] = cols
    summary_file = path / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    return RunData(
        path=path,
        name=str(config.get("name") or path.name),
        config=config,
        config_text=config_text,
        labels=labels,
        seeds=sorted(seeds),
        metrics=metrics,
        clusters=_clusters(_read_csv(path / "clusters.csv")),
        events=_read_csv(path / "events.csv"),
        diagnostics=_diagnostics(_read_csv(path / "diagnostics.csv")),
        summary=summary,
        select_k=_read_csv(path / "select_k.csv"),
        assign=_read_csv(path / "assign.csv"),
    )


def _clusters(rows: list[dict[str, str]]) -> dict[tuple[str, int], dict[str, np.ndarray]]:
    """Per job: ``assign[client, round]`` (−1: not present), ``groups`` and ``rounds``."""
    grouped: dict[tuple[str, int], list[dict[str, str]]] = {}
    for r in rows:
        grouped.setdefault((r["algorithm"], int(r["seed"])), []).append(r)
    out = {}
    for key, job in grouped.items():
        rnd = np.array([int(r["round"]) for r in job])
        client = np.array([int(r["client"]) for r in job])
        rounds, clients = np.unique(rnd), np.unique(client)
        assign = np.full((len(clients), len(rounds)), -1)
        assign[np.searchsorted(clients, client), np.searchsorted(rounds, rnd)] = [
            int(r["cluster"]) for r in job
        ]
        groups = np.full(len(clients), -1)
        for r, c in zip(job, client, strict=True):
            if r["true_group"] != "":
                groups[np.searchsorted(clients, c)] = int(r["true_group"])
        out[key] = {"assign": assign, "groups": groups, "rounds": rounds, "clients": clients}
    return out


def _diagnostics(rows: list[dict[str, str]]) -> dict[tuple[str, int, str], Series]:
    grouped: dict[tuple[str, int, str], list[tuple[int, float]]] = {}
    for r in rows:
        key = (r["algorithm"], int(r["seed"]), r["name"])
        grouped.setdefault(key, []).append((int(r["round"]), _float(r["value"])))
    return {
        k: Series(np.array([p[0] for p in v]), np.array([p[1] for p in v]))
        for k, v in grouped.items()
    }
