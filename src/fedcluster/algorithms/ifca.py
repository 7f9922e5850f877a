"""IFCA: Ghosh, Chung, Yin, Ramchandran, "An efficient framework for clustered
federated learning", NeurIPS 2020, Alg. 1 (model averaging variant).

Each selected client evaluates the K broadcast cluster models on its data and
picks the one with the lowest loss (the cluster identity estimate
ĵ = argmin_j F_i(θ_j)); it trains that model and uploads it with its choice;
the server averages per cluster, weighted by sample count. IFCA is JGL with
λ = 0 (JGL eq. 4). ``min_cluster_share`` enables the reference code's "good
initializer" (see :mod:`fedcluster.algorithms.cluster_models`).
``choice_on_device`` makes the choice and the training one message, as Alg. 1
has the client do both (:data:`fedcluster.algorithms.jgl.CHOOSE_AND_TRAIN`
with the loss rule; ties broken on the device). ``shared_layers`` is the
paper's weight sharing (Sec. 5; its CIFAR experiments share all layers but the
last): :mod:`fedcluster.algorithms.cluster_models`.
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
    ClusterModelState,
    argmax_random_ties,
)
from fedcluster.algorithms.jgl import CHOOSE_AND_TRAIN
from fedcluster.protocol.channel import Replies
from fedcluster.protocol.computation import ClientComputation, Payload, Settings


class IFCAParams(ClusterModelParams):
    weighting: Literal["uniform", "samples"] = "samples"
    choice_batches: Literal["one", "all"] = Field(
        "one", description="loss on one mini-batch (cheap) or on all local training data"
    )


@register
class IFCA(ClusterModelAlgorithm[IFCAParams]):
    """IFCA (Ghosh et al. 2020)."""

    name = "ifca"
    Params = IFCAParams

    def choice_batches(self) -> str:
        return self.params.choice_batches

    def choose(self, state: ClusterModelState, rnd: int, selected: np.ndarray) -> Choice:
        replies = self.model_losses(state.models, selected, rnd, "decide", self.choice_batches())
        choice = argmax_random_ties(-replies["losses"], self.tie_rng(rnd))
        return Choice(replies.clients, choice)

    def choose_and_train(
        self, state: ClusterModelState, rnd: int, selected: np.ndarray
    ) -> tuple[Replies, dict[str, float]]:
        """The choice (lowest loss) and the training in one message per node."""
        computation, rule, shared = self.device_choice(state)
        return self.ask_device_choice(computation, state, rnd, selected, rule, shared), {}

    def device_choice(
        self, state: ClusterModelState
    ) -> tuple[ClientComputation, Settings, Payload]:
        """The lowest loss among the K models, on the device (:data:`CHOOSE_AND_TRAIN`)."""
        return CHOOSE_AND_TRAIN, {"rule": "loss", "batches": self.params.choice_batches}, {}
