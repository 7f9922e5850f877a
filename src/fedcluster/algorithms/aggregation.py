"""Per-cluster aggregation shared by the clustered algorithms.

- :func:`cluster_average`: each cluster's model is the (sample-weighted or
  uniform) mean of its members' uploaded models -- JGL eq. 7, IFCA's model
  averaging, DCFL eq. 5, FedGroup Alg. 2, FeSEM's M-step, CFL's per-cluster
  FedAvg; with ``shared`` columns, IFCA's weight sharing (Ghosh et al. 2020,
  Sec. 5): those columns are averaged over every member of every cluster.
- :func:`eval_rows_with_average`: the cluster models plus their average, the
  model a client without a cluster uses (DCFL's W_G, FedGroup's auxiliary
  global model).
"""

from __future__ import annotations

import numpy as np
import torch

from fedcluster.algorithms.robust import MEAN, Aggregate, Aggregator
from fedcluster.engine.flat import group_averages


def cluster_average(
    rows: torch.Tensor,
    labels: np.ndarray,
    previous: torch.Tensor,
    weights: np.ndarray | None = None,
    aggregate: Aggregate = MEAN,
    start: torch.Tensor | None = None,
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-cluster (weighted) mean of ``rows`` [n, d] grouped by ``labels`` [n].

    Returns a copy of ``previous`` [K, d] in which every cluster holding at
    least one row is replaced by the mean of its rows (uniform, or weighted by
    ``weights`` [n], e.g. sample counts); clusters without rows keep their
    previous row. ``aggregate`` (the run's rule, :mod:`fedcluster.algorithms.robust`)
    may replace the mean by a robust rule; the members' updates are measured
    from ``start`` [n, d] (the models they trained from), by default from the
    cluster's previous row. ``shared`` columns (the same in every row of
    ``previous``) become, in all K rows, the aggregate of all n rows' columns
    with the same weights: layers the clusters share (IFCA's weight sharing).
    """
    out = previous.clone()
    w = torch.ones(len(labels)) if weights is None else torch.as_tensor(weights)
    if type(aggregate) is Aggregator and aggregate.rule == "mean":  # the mean needs no start
        names, means = group_averages(rows, labels, w)
        out[torch.as_tensor(names)] = means
    else:
        for c in np.unique(labels):
            members = torch.as_tensor(labels == c)
            base = previous[int(c)] if start is None else start[members]
            out[int(c)] = aggregate(base, rows[members], w[members])
    if shared is not None and len(labels):
        base = previous[0, shared] if start is None else start[:, shared]
        out[:, shared] = aggregate(base, rows[:, shared], w)
    return out


def eval_rows_with_average(
    models: torch.Tensor, assign: np.ndarray
) -> tuple[torch.Tensor, np.ndarray]:
    """Cluster models [K, d] plus their average; clients without a cluster (−1) use the average.

    The average of the cluster models is DCFL's W_G (the model a newcomer
    receives, Alg. 1 line 6) and FedGroup's auxiliary global model.
    """
    rows = torch.cat([models, models.mean(dim=0, keepdim=True)])
    return rows, np.where(assign >= 0, assign, len(models)).astype(np.int64)
