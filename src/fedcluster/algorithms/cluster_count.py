"""``n_clusters: auto``: the number of clusters chosen before round 1 (docs/clustering.md).

An algorithm that takes the number of clusters K as a parameter names it in
:attr:`~fedcluster.algorithms.base.Algorithm.cluster_count` (``n_clusters``,
FedGroup's ``n_groups``, FedEM's ``n_components``). Given the value ``auto``
(with ``k_range: [lo, hi]``, default [2, 8] capped at n − 1), the job first
runs a warm-up: every client present at round 1 trains once from the initial
model w0 with the run's local-training settings and uploads its model, through
the channel (local DP, rejection and byte counting apply; the traffic counts in
round 1). The updates w_i − w0 (what clustering compares,
:meth:`~fedcluster.algorithms.base.Context.clustering_view`) are clustered by
k-means for each K of the range, and the K of the largest mean silhouette is
chosen (:mod:`fedcluster.clustering.select_k`). The criterion does not depend
on the algorithm, so every algorithm of a seed sees the same curve. The job
then runs with that K; the curve is written to the run directory
(``select_k.csv``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fedcluster.clustering.select_k import choose_k, silhouette_curve
from fedcluster.errors import ConfigError, FedclusterError
from fedcluster.rng import numpy_rng

if TYPE_CHECKING:
    from fedcluster.algorithms.base import Context

AUTO = "auto"
DEFAULT_K_RANGE = (2, 8)
COUNT_NAMES = ("n_clusters", "n_groups", "n_components")
"""The names the built-in algorithms give K: ``auto`` under another one is named as misplaced."""
AUTO_HELP = " ('auto': chosen before round 1, range k_range [2, 8]; docs/clustering.md)"
"""Appended to the description of each algorithm's cluster-count parameter."""
WARMUP_ROUND = 0
"""The round number of the warm-up's training (its random streams differ from round 1's)."""


@dataclass(frozen=True)
class AutoK:
    """A request to choose K: the parameter that holds it and the range to search
    (``None``: :data:`DEFAULT_K_RANGE` capped at the number of clients − 1)."""

    field: str
    k_range: tuple[int, int] | None
    where: str


def parse_auto(
    name: str, field: str | None, params: dict[str, Any], where: str
) -> tuple[dict[str, Any], AutoK | None]:
    """Split ``k_range`` and an ``auto`` K off algorithm ``name``'s ``params``.

    Returns the parameters without them (the algorithm's default K stands in
    until K is chosen) and the request, or ``params`` unchanged and ``None``.
    ``field`` is the parameter that holds K (``None``: the algorithm has none).
    A misplaced ``auto`` or ``k_range`` and a bad range are one-line ConfigErrors.
    """
    rest = dict(params)
    k_range = rest.pop("k_range", None)
    has_range = "k_range" in params
    if field is None or rest.get(field) != AUTO:
        misplaced = [k for k in COUNT_NAMES if rest.get(k) == AUTO]
        if has_range or misplaced:
            key = "k_range" if has_range else misplaced[0]
            target = f"{field}: auto" if field else "a cluster count"
            raise ConfigError(
                f"field '{where}.{key}': applies only with {target}; {name} "
                + (f"takes {field} as a number or 'auto'" if field else "has no cluster count")
            )
        return params, None
    del rest[field]
    return rest, AutoK(field, None if k_range is None else _check_range(k_range, where), where)


def _check_range(value: Any, where: str) -> tuple[int, int]:
    ok = (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )
    if not ok or not 2 <= value[0] <= value[1]:
        raise ConfigError(
            f"field '{where}.k_range': expected [lo, hi], two integers with 2 <= lo <= hi "
            f"(the silhouette needs at least 2 clusters), got {value!r}"
        )
    return int(value[0]), int(value[1])


def k_range_for(auto: AutoK, n_clients: int) -> tuple[int, int]:
    """The range searched for ``n_clients`` warm-up updates: the given one, which
    must fit (K ≤ n − 1), or the default capped at n − 1."""
    if auto.k_range is None:
        lo, hi = DEFAULT_K_RANGE
        if n_clients < lo + 1:
            raise FedclusterError(
                f"{auto.where}.{auto.field}: auto needs at least 3 clients' warm-up "
                f"updates, got {n_clients}"
            )
        return lo, min(hi, n_clients - 1)
    lo, hi = auto.k_range
    if hi > n_clients - 1:
        raise ConfigError(
            f"field '{auto.where}.k_range': [{lo}, {hi}] needs K <= n - 1 = {n_clients - 1} "
            f"({n_clients} clients' warm-up updates)"
        )
    return lo, hi


def select_k(ctx: Context, auto: AutoK, clients: np.ndarray) -> tuple[int, dict[int, float]]:
    """Warm up ``clients`` from ``ctx.init_row``; the chosen K and the silhouette curve."""
    ex = ctx.exchange(clients, ctx.init_row, WARMUP_ROUND)
    who = f"{auto.field}: auto"
    _, updates = ctx.clustering_view(ex.clients, ctx.init_row, ex.rows - ctx.init_row, who)
    k_range = k_range_for(auto, len(ex.clients))
    seed = int(numpy_rng(ctx.seed, "select-k").integers(2**31))
    curve = silhouette_curve(updates, k_range, random_state=seed)
    return choose_k(curve), curve
