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
from pydantic import Field

from fedcluster.algorithms.base import register
from fedcluster.algorithms.cluster_models import (
    Choice,
    ClusterModelAlgorithm,
    ClusterModelParams,
    State,
    argmax_random_ties,
)


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

    def choose(self, state: State, rnd: int, selected: np.ndarray) -> Choice:
        replies = self.model_losses(
            state.models, selected, rnd, "decide", self.params.choice_batches
        )
        choice = argmax_random_ties(-replies["losses"], self.tie_rng(rnd))
        return Choice(replies.clients, choice)
