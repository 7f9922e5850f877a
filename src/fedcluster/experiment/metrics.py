"""Per-round metrics: the columns of ``metrics.csv`` and how they are computed.

- ``accuracy``: test accuracy over all clients' test samples pooled, each
  client using the model it would use (in a dynamic federation, the clients
  present in the round, :mod:`fedcluster.experiment.scenario`); ``accuracy_mean`` /
  ``accuracy_std``:
  mean and standard deviation of the per-client accuracies (the papers'
  "average test accuracy of all users", e.g. JGL Sec. III-A-3, DCFL Table I).
- ``loss``: sample-weighted training loss of the round's participants;
  ``test_loss``: pooled test loss.
- ``bytes_up`` / ``bytes_down``: payloads of the round, counted where sent;
  ``rejected``: uploads the server refused (non-finite values, absurd norms);
  ``failed``: contacted clients that never replied (``scenario.failure_rate``).
- ``epsilon``: with local differential privacy (``privacy:``), the largest ε
  any client has spent so far (at the configured δ; :mod:`fedcluster.privacy.ledger`);
  empty without it.
- ``purity`` (JGL Sec. III-A-3), ``ari``, ``nmi`` against the ground-truth
  groups, and ``n_clusters``, for algorithms that cluster clients;
  ``n_clusters`` is empty while no client is assigned (e.g. CFLGT's and
  FL+HC's pre-training), not 0. Where a method forms fewer clusters than the
  ground truth has groups, purity cannot reach 1: the row dict also carries
  ``purity_ceiling`` (:func:`~fedcluster.clustering.validity.purity_ceiling`,
  the best purity with that many clusters), which ``summary.json`` /
  ``summary.md`` report beside the final purity (it is not a ``metrics.csv``
  column: it follows from ``n_clusters`` and the group sizes in
  ``clusters.csv``), and :func:`note_cluster_shortfall` says so once per job.
- With faulty clients, ``diagnostics.csv`` also gets ``honest_accuracy``
  (:func:`honest_accuracy`): the pooled accuracy of the sound clients only.
- ``client_seconds`` (client computations), ``server_seconds`` (the rest of
  the round) and ``eval_seconds``.
"""

from __future__ import annotations

import logging
import math
from typing import SupportsFloat, cast

import numpy as np

from fedcluster.clustering.validity import ari, nmi, purity, purity_ceiling
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

log = logging.getLogger("fedcluster")


def accuracy_columns(result: EvalResult) -> dict[str, float]:
    """Pooled and per-client accuracy and the pooled test loss; NaN (an empty cell) when
    no client's evaluation counted (all failed or were rejected, e.g. a model or loss
    giving NaN: events.csv names each), never an accuracy of 0."""
    has = result.count > 0
    per_client = result.accuracy[has]
    total = result.count.sum()
    return {
        "accuracy": float(result.correct.sum() / total) if total else math.nan,
        "accuracy_mean": float(per_client.mean()) if has.any() else math.nan,
        "accuracy_std": float(per_client.std()) if has.any() else math.nan,
        "test_loss": float(result.loss_sum.sum() / total) if total else math.nan,
    }


def honest_accuracy(result: EvalResult, sound: np.ndarray) -> dict[str, float]:
    """``{"honest_accuracy": pooled test accuracy of the sound clients}`` when some are faulty.

    ``sound`` masks all clients of the federation; ``result.clients`` says which
    of them the result covers.

    With faulty clients (``scenario.faulty``) the pooled ``accuracy`` also
    counts the attackers' own test data under models they corrupted; the
    Byzantine-robustness literature measures the honest clients (e.g. Yin et
    al., ICML 2018; Cao et al., NDSS 2021). A ``diagnostics.csv`` row, not a
    ``metrics.csv`` column; empty (``{}``) when every client is sound.
    """
    if sound.all():
        return {}
    assert result.clients is not None, "honest_accuracy needs the evaluated clients"
    mine = sound[result.clients]
    correct, count = result.correct[mine].sum(), result.count[mine].sum()
    return {"honest_accuracy": float(correct / count) if count else math.nan}


def cluster_columns(assign: np.ndarray | None, groups: np.ndarray | None) -> dict[str, float]:
    """Purity, ARI and NMI of the assigned clients against ground truth, and the cluster count.

    Also ``purity_ceiling`` and ``n_groups`` (the ground-truth groups among the
    assigned clients), which are not ``metrics.csv`` columns. All NaN while no
    client is assigned.
    """
    nan = {
        "purity": math.nan,
        "ari": math.nan,
        "nmi": math.nan,
        "n_clusters": math.nan,
        "purity_ceiling": math.nan,
        "n_groups": math.nan,
    }
    if assign is None:
        return nan
    known = assign >= 0
    if not known.any():
        return nan
    n_clusters = len(np.unique(assign[known]))
    out = dict(nan, n_clusters=float(n_clusters))
    if groups is None:
        return out
    t, p = groups[known], assign[known]
    sizes = np.unique(t, return_counts=True)[1]
    out.update(
        purity=purity(t, p),
        ari=ari(t, p),
        nmi=nmi(t, p),
        purity_ceiling=purity_ceiling(sizes, n_clusters),
        n_groups=float(len(sizes)),
    )
    return out


def note_cluster_shortfall(label: str, seed: int, rows: list[dict[str, object]]) -> None:
    """Log once, at the end of a job, if its last clustering has fewer clusters than groups."""
    last = next((r for r in reversed(rows) if _finite(r.get("n_groups"))), None)
    if last is None:
        return
    clusters = float(cast(SupportsFloat, last["n_clusters"]))
    groups = float(cast(SupportsFloat, last["n_groups"]))
    if not clusters < groups:
        return
    log.info(
        "%s seed %d: %d clusters for %d ground-truth groups at round %s, so purity can reach at "
        "most %.3f (purity_ceiling in summary.json); ARI/NMI are the fairer scores",
        label,
        seed,
        int(clusters),
        int(groups),
        last["round"],
        last["purity_ceiling"],
    )


def _finite(v: object) -> bool:
    return isinstance(v, float) and not math.isnan(v)


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
