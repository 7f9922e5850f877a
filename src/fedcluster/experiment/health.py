"""Warnings from a method's own diagnostics: signs that a clustered run did not cluster.

Three signs, each checked in the shared code (the runner, the label-free assignment),
never per method, and each one line, logged and written to ``events.csv`` (kind
``warning``, client −1):

- **one cluster for all clients**: after the last round a clustered method serves
  every present client from one cluster model -- it ran as FedAvg (CFL's split never
  came, IFCA's clusters collapsed, ...): without a split, CFL (Sattler et al.,
  "Clustered Federated Learning", IEEE TNNLS 2021) is FedAvg.
- **a near tie in the automatic choice of K**: the silhouette of the chosen K
  exceeds the runner-up's by less than :data:`NEAR_TIE` (e.g. 0.0811 against 0.0809):
  the curve does not tell the Ks apart, and the seed decides (Rousseeuw,
  "Silhouettes: a graphical aid to the interpretation and validation of cluster
  analysis", J. Comput. Appl. Math. 20, 1987: the average silhouette width is the
  criterion, and close widths mean equally good -- or equally poor -- partitions).
- **a label-free rule that gives every device the same model**: among several
  devices (not all of one known group) and several cluster models, the rule
  (prediction entropy or confidence, :mod:`fedcluster.experiment.cluster_choice`)
  chose one model for all of them, so it told nothing apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from fedcluster.experiment.cluster_choice import Assignment

NEAR_TIE = 0.005
"""Silhouette margin (of the chosen K over the runner-up) below which the choice is a tie."""
WARNING = "warning"
"""The ``kind`` of a warning in ``events.csv``."""
NO_CLIENT = -1
"""The ``client`` of an event that concerns no single client."""


def one_cluster(clusters: np.ndarray, present: np.ndarray) -> str | None:
    """The warning when every present, assigned client shares one cluster (two or more
    such clients), else None."""
    assigned = clusters[present & (clusters >= 0)]
    if len(assigned) < 2 or len(np.unique(assigned)) > 1:
        return None
    return (
        f"all {len(assigned)} clients ended in one cluster: the clustered method ran as "
        "a single model"
    )


def near_tie(curve: Mapping[int, float], chosen: int) -> str | None:
    """The warning when the silhouette of ``chosen`` beats the best other K's by less
    than :data:`NEAR_TIE`, else None."""
    others = {k: v for k, v in curve.items() if k != chosen and np.isfinite(v)}
    if chosen not in curve or not others:
        return None
    runner_up = max(others, key=lambda k: others[k])
    margin = curve[chosen] - others[runner_up]
    if margin >= NEAR_TIE:
        return None
    return (
        f"automatic K: silhouette {curve[chosen]:.4f} at K={chosen} against "
        f"{others[runner_up]:.4f} at K={runner_up}, a near tie (margin below {NEAR_TIE})"
    )


def same_model(
    assignments: Sequence[Assignment], rules: Sequence[str]
) -> list[tuple[str, int, str]]:
    """``(algorithm, seed, warning)`` per job and label-free rule that gave every device
    the same model, when the job offered two or more models to two or more devices that
    are not all of one known group."""
    jobs: dict[tuple[str, int], list[Assignment]] = {}
    for a in assignments:
        jobs.setdefault((a.algorithm, a.seed), []).append(a)
    found = []
    for (algorithm, seed), mine in jobs.items():
        groups = {a.group for a in mine}
        if len(mine) < 2 or len(mine[0].models) < 2 or (len(groups) == 1 and None not in groups):
            continue  # one model for devices of one known group is no sign of trouble
        for rule in rules:
            chosen = {a.chosen[rule] for a in mine if rule in a.chosen}
            if len(chosen) == 1:
                line = (
                    f"the label-free rule {rule!r} gave all {len(mine)} devices model "
                    f"{chosen.pop()} (of {len(mine[0].models)} candidates)"
                )
                found.append((algorithm, seed, line))
    return found
