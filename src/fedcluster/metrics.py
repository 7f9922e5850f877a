"""Per-round metrics: the columns of ``metrics.csv`` and how they are computed.

- ``accuracy``: test accuracy over all clients' test samples pooled, each
  client using the model it would use (in a dynamic federation, the clients
  present in the round, :mod:`fedcluster.scenario`); ``accuracy_mean`` / ``accuracy_std``:
  mean and standard deviation of the per-client accuracies (the papers'
  "average test accuracy of all users", e.g. JGL Sec. III-A-3, DCFL Table I).
- ``loss``: sample-weighted training loss of the round's participants;
  ``test_loss``: pooled test loss.
- ``bytes_up`` / ``bytes_down``: payloads of the round, counted where sent;
  ``rejected``: uploads the server refused (non-finite values, absurd norms);
  ``failed``: contacted clients that never replied (``scenario.failure_rate``).
- ``epsilon``: with local differential privacy (``privacy:``), the largest ε
  any client has spent so far (at the configured δ; :mod:`fedcluster.privacy`);
  empty without it.
- ``purity`` (JGL Sec. III-A-3), ``ari``, ``nmi`` against the ground-truth
  groups, and ``n_clusters``, for algorithms that cluster clients.
- ``client_seconds`` (client computations), ``server_seconds`` (the rest of
  the round) and ``eval_seconds``.
"""

from __future__ import annotations

import math

import numpy as np

from fedcluster.clustering.validity import ari, nmi, purity
from fedcluster.engine.results import EvalResult

COLUMNS = [
    "round",
    "algorithm",
    "seed",
    "accuracy",
    "accuracy_mean",
    "accuracy_std",
    "loss",
    "test_loss",
    "purity",
    "ari",
    "nmi",
    "n_clusters",
    "bytes_up",
    "bytes_down",
    "rejected",
    "failed",
    "epsilon",
    "client_seconds",
    "server_seconds",
    "eval_seconds",
]
TIMING_COLUMNS = ("client_seconds", "server_seconds", "eval_seconds")


def accuracy_columns(result: EvalResult) -> dict[str, float]:
    """Pooled and per-client accuracy and the pooled test loss."""
    has = result.count > 0
    per_client = result.accuracy[has]
    return {
        "accuracy": float(result.correct.sum() / max(result.count.sum(), 1)),
        "accuracy_mean": float(per_client.mean()) if has.any() else math.nan,
        "accuracy_std": float(per_client.std()) if has.any() else math.nan,
        "test_loss": float(result.loss_sum.sum() / max(result.count.sum(), 1)),
    }


def cluster_columns(assign: np.ndarray | None, groups: np.ndarray | None) -> dict[str, float]:
    """Purity, ARI and NMI of the assigned clients against ground truth, and the cluster count."""
    nan = {"purity": math.nan, "ari": math.nan, "nmi": math.nan, "n_clusters": math.nan}
    if assign is None:
        return nan
    known = assign >= 0
    out = dict(nan, n_clusters=float(len(np.unique(assign[known]))))
    if groups is None or not known.any():
        return out
    t, p = groups[known], assign[known]
    out.update(purity=purity(t, p), ari=ari(t, p), nmi=nmi(t, p))
    return out


def format_row(row: dict[str, object]) -> list[str]:
    """A metrics row as CSV strings: floats with full precision, NaN as empty."""
    out = []
    for col in COLUMNS:
        v = row.get(col, math.nan)
        if isinstance(v, float):
            out.append("" if math.isnan(v) else repr(v))
        else:
            out.append(str(v))
    return out
