"""Per-client test results of an evaluation round: the rows of ``clients.csv``.

Clustered FL papers report accuracy per client and per group, not only the
pooled mean: fairness across clients (the worst clients' accuracy; e.g. Ghosh
et al., "An Efficient Framework for Clustered Federated Learning", NeurIPS
2020, Sec. 5, and Sattler et al., "Clustered Federated Learning", IEEE TNNLS
2021, Sec. VI, which report per-client accuracies) and accuracy per cluster.
Each row is one client's test accuracy ``correct / samples`` and mean test
loss ``loss_sum / samples`` under the model it would use at that round
(:meth:`~fedcluster.algorithms.base.Algorithm.evaluate`), with its true group
and its cluster.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fedcluster.engine.results import EvalResult

CLIENT_COLUMNS = [
    "round",
    "algorithm",
    "seed",
    "client",
    "group",
    "cluster",
    "accuracy",
    "loss",
    "samples",
]


def client_records(
    label: str,
    seed: int,
    rnd: int,
    result: EvalResult,
    clusters: np.ndarray | None,
    groups: np.ndarray | None,
) -> list[dict[str, Any]]:
    """One record per evaluated client (keys :data:`CLIENT_COLUMNS`).

    ``group`` is ``None`` without ground truth, ``cluster`` ``None`` for an
    unclustered method; accuracy and loss are NaN for a client without test data.
    """
    assert result.clients is not None, "client_records needs the evaluated clients"
    records = []
    for i, client in enumerate(np.asarray(result.clients).tolist()):
        samples = int(result.count[i])
        records.append(
            {
                "round": rnd,
                "algorithm": label,
                "seed": seed,
                "client": client,
                "group": None if groups is None else int(groups[client]),
                "cluster": None if clusters is None else int(clusters[client]),
                "accuracy": float(result.correct[i]) / samples if samples else math.nan,
                "loss": float(result.loss_sum[i]) / samples if samples else math.nan,
                "samples": samples,
            }
        )
    return records


def client_line(record: dict[str, Any]) -> list[str]:
    """A record as ``clients.csv`` strings: floats at full precision, NaN and None empty."""
    out = []
    for column in CLIENT_COLUMNS:
        value = record[column]
        if value is None or (isinstance(value, float) and math.isnan(value)):
            out.append("")
        else:
            out.append(repr(value) if isinstance(value, float) else str(value))
    return out


CLIENT_DTYPES = {"algorithm": str, "group": "Int64", "cluster": "Int64"}
"""Columns pandas would not type by itself: labels that look like numbers stay text, and
an empty group or cluster (no ground truth, an unclustered method) is missing (``<NA>``)
in an integer column."""


def read_clients(path: str | Path) -> pd.DataFrame:
    """A run directory's ``clients.csv`` as a DataFrame (no rows where the file is absent:
    a run made before per-client results were recorded)."""
    file = Path(path) / "clients.csv"
    if not file.is_file():
        return pd.DataFrame(
            {c: pd.Series(dtype=CLIENT_DTYPES.get(c, float)) for c in CLIENT_COLUMNS}
        )
    return pd.read_csv(file, dtype=CLIENT_DTYPES)
