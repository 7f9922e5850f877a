"""IFCA: Ghosh, Chung, Yin, Ramchandran, "An efficient framework for clustered
federated learning", NeurIPS 2020, Alg. 1 (model averaging variant).

Each selected client evaluates the K broadcast cluster models on its data and
picks the one with the lowest loss (the cluster identity estimate
ĵ = argmin_j F_i(θ_j)); it trains that model and uploads it with its choice;
the server averages per cluster, weighted by sample count. IFCA is JGL with
λ = 0 (JGL eq. 4). ``min_cluster_share`` enables the reference code's "good
initializer" (see :mod:`fedcluster.algorithms.cluster_models`).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field

from fedcluster.algorithms.base import register
from fedcluster.algorithms.cluster_models import (
    ClusterModelAlgorithm,
    ClusterModelParams,
    State,
    argmax_random_ties,
)
from fedcluster.algorithms.evaluation import mean_losses, per_model_results


class IFCAParams(ClusterModelParams):
    weighting: Literal["uniform", "samples"] = "samples"
    choice_batches: Literal["one", "all"] = Field(
        "one", description="loss on one mini-batch (cheap) or on all local training data"
    )


@register
class IFCA(ClusterModelAlgorithm):
    """IFCA (Ghosh et al. 2020)."""

    name = "ifca"
    Params = IFCAParams

    def choose(self, state: State, rnd: int, selected: np.ndarray) -> np.ndarray:
        ctx = self.ctx
        if self.params.choice_batches == "all":
            loss = _full_data_losses(self, state, selected)
        else:
            loss, _ = ctx.sim.losses_and_grads(
                selected, state["models"], ctx.train, rnd, "decide", with_grads=False
            )
        return argmax_random_ties(-loss, self.tie_rng(rnd))


def _full_data_losses(alg: IFCA, state: State, selected: np.ndarray) -> torch.Tensor:
    """Mean training loss of every model on each client's whole training set [n, K]."""
    return mean_losses(per_model_results(alg.ctx.sim, selected, state["models"], "train"))
