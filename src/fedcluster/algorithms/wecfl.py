"""WeCFL: Ma, Long, Zhou, Jiang, Zhang, "On the convergence of clustered federated
learning", arXiv:2202.06187, 2022 (weighted clustered FL, Alg. 1; reference code
github.com/jie-ma-ai/FedBase, ``baselines/wecfl.py``, and the Flower strategy of a
clustered-FL library built on it).

Every round, the selected clients train the model of their cluster and upload
it with their sample count n_i; the server then runs **k-means over the uploaded
models with data-size weights**, alternating

- assignment: each client joins the nearest cluster model, r_i = argmin_k ‖w_i − c_k‖;
- aggregation: each cluster model becomes the data-size-weighted mean of its
  members, c_k = Σ_{r_i=k} n_i w_i / Σ_{r_i=k} n_i (the cluster's FedAvg),

until no assignment changes (or ``max_iterations``): Lloyd's algorithm on the
weighted k-means objective Σ_i n_i ‖w_i − c_{r_i}‖² whose convergence the paper
analyses. A cluster that loses all members keeps its model.

This is FeSEM's round (:mod:`fedcluster.algorithms.fesem`: one assignment and
one average, uniform weights) with the weights and the alternation run to a
fixed point; WeCFL inherits its initialisation (k-means++ seeds among the first
round's models, or K random models) and its handling of rejected uploads,
newcomers and drift. The reference code restarts scikit-learn's k-means from
scratch every round (``n_init=5``); here it is warm-started from the current
cluster models, so a cluster keeps its identity across rounds and no random
restarts are drawn (deterministic).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field

from fedcluster.algorithms.aggregation import cluster_average
from fedcluster.algorithms.base import register
from fedcluster.algorithms.fesem import FeSEM, FeSEMParams
from fedcluster.algorithms.robust import MEAN, Aggregate


class WeCFLParams(FeSEMParams):
    weighting: Literal["samples"] = Field("samples", description="data-size weights n_i")
    max_iterations: int = Field(
        100, ge=1, description="k-means iterations per round (stops earlier when stable)"
    )


def weighted_lloyd(
    rows: torch.Tensor,
    choice: np.ndarray,
    centres: torch.Tensor,
    weights: np.ndarray,
    max_iterations: int,
    aggregate: Aggregate = MEAN,
) -> tuple[torch.Tensor, np.ndarray]:
    """Weighted k-means (Lloyd) from the assignment ``choice`` [n] of ``rows`` [n, d]:
    average each cluster's members (``weights`` [n]; empty clusters keep their row of
    ``centres`` [K, d]), re-assign every row to its nearest centre, until no assignment
    changes or ``max_iterations`` averages. Returns the centres and the assignment."""
    centres = cluster_average(rows, choice, centres, weights, aggregate)
    for _ in range(max_iterations - 1):
        again = torch.cdist(rows.double(), centres.double()).argmin(dim=1).numpy()
        if np.array_equal(again, choice):
            break
        choice = again
        centres = cluster_average(rows, choice, centres, weights, aggregate)
    return centres, choice


@register
class WeCFL(FeSEM):
    """WeCFL (Ma et al. 2022): weighted k-means over client models, alternating with
    per-cluster aggregation."""

    name = "wecfl"
    Params: type[WeCFLParams] = WeCFLParams
    params: WeCFLParams

    def m_step(
        self, local: torch.Tensor, choice: np.ndarray, centres: torch.Tensor, weights: np.ndarray
    ) -> tuple[torch.Tensor, np.ndarray]:
        """Weighted Lloyd iterations from the nearest-centre assignment (module docstring)."""
        return weighted_lloyd(
            local, choice, centres, weights, self.params.max_iterations, self.ctx.aggregate
        )
