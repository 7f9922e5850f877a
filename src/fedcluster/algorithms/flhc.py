"""FL+HC: Briggs, Fan, Andras, "Federated learning with hierarchical clustering of local
updates to improve training on non-IID data", IJCNN 2020.

1. ``pretrain_rounds`` rounds of FedAvg of the global model (the runner's
   selected clients);
2. one clustering round: *every* (reachable) client trains from the global model with the
   usual local-training settings and uploads its model; the server clusters
   the (accepted) updates ΔW_i = w_i − w_global by agglomerative hierarchical
   clustering with euclidean distance and the chosen linkage (Briggs et al.
   recommend ward), cut at ``n_clusters`` clusters *or* at ``distance_threshold``
   (exactly one; on scikit-learn's linkage-distance scale);
3. later rounds: every cluster trains independently with FedAvg, each cluster
   model starting from the global model; the runner's selected clients train
   their own cluster's model, and clients never change cluster.

The clustering round's locally trained models only serve the clustering, as
in the paper; each cluster's mean update ΔW is kept (``state.mean_updates``)
to place newcomers (see :mod:`fedcluster.algorithms.cflgt`: a newcomer trains
from the global model and joins the cluster with the nearest mean update).
The default 25 pre-training rounds and 5 clusters follow CFLGT's
comparison (the CFLGT paper, Sec. V-A: 25 pre-training rounds;
scenario 1 has 5 groups; Table II runs FL+HC with 10, 20 and 30 clusters).
The schedule is shared with CFLGT (:class:`~fedcluster.algorithms.cflgt.OneShotClustering`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from pydantic import Field, model_validator

from fedcluster.algorithms.aggregation import cluster_average
from fedcluster.algorithms.base import log, register, weighted_loss
from fedcluster.algorithms.cflgt import OneShotClustering, OneShotParams, OneShotState
from fedcluster.clustering.methods import Linkage, hierarchical
from fedcluster.errors import ConfigError


class FLHCParams(OneShotParams):
    linkage: Linkage = Field("ward", description="linkage of the hierarchical clustering")
    n_clusters: int | None = Field(
        5, ge=1, description="number of clusters (cleared when distance_threshold is given)"
    )
    distance_threshold: float | None = Field(
        None, gt=0.0, description="cut the dendrogram at this linkage distance instead"
    )

    @model_validator(mode="before")
    @classmethod
    def _exactly_one_cut(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("distance_threshold") is not None:
            if data.get("n_clusters") is not None:
                raise ValueError("give exactly one of n_clusters and distance_threshold")
            return {**data, "n_clusters": None}
        if "n_clusters" in data and data["n_clusters"] is None:
            raise ValueError("give n_clusters or distance_threshold")
        return data


@dataclass
class FLHCState(OneShotState):
    mean_updates: torch.Tensor | None = None
    """Each cluster's mean clustering-round update ΔW [K, d] (places newcomers)."""


@register
class FLHC(OneShotClustering[FLHCParams, FLHCState]):
    """FL+HC (Briggs et al. 2020): FedAvg, clustering of the updates, per-cluster FedAvg."""

    name = "flhc"
    Params = FLHCParams
    StateType = FLHCState

    def init_state(self) -> FLHCState:
        return replace(super().init_state(), mean_updates=torch.empty(0, self.ctx.dim))

    def cluster_clients(self, state: FLHCState, rnd: int) -> tuple[FLHCState, np.ndarray, float]:
        ctx = self.ctx
        p = self.params
        if p.n_clusters is not None and p.n_clusters > ctx.n_clients:
            raise ConfigError(
                f"flhc.n_clusters: {p.n_clusters} clusters for only {ctx.n_clients} clients"
            )
        clients = ctx.available_clients()
        ex = ctx.exchange(clients, state.global_model, rnd)
        loss = weighted_loss(ex.loss, ctx.train_sizes[ex.clients])
        labels = np.full(ctx.n_clients, -1, dtype=np.int64)
        if len(ex.clients) < (p.n_clusters or 1):
            log.warning(
                "flhc: %d accepted updates for %s clusters; clustering again next round",
                len(ex.clients),
                p.n_clusters,
            )
            return state, labels, loss
        updates = ex.rows - state.global_model
        labels[ex.clients] = hierarchical(
            features=ctx.compared(updates),
            n_clusters=p.n_clusters,
            distance_threshold=p.distance_threshold,
            linkage=p.linkage,
        )
        found = labels[ex.clients]
        mean_updates = cluster_average(
            updates, found, torch.zeros(int(found.max()) + 1, ctx.dim), aggregate=ctx.aggregate
        )
        return replace(state, mean_updates=mean_updates), labels, loss

    def place_newcomers(self, state: FLHCState, clients: np.ndarray, rnd: int) -> np.ndarray:
        """Nearest mean clustering-round update (:mod:`fedcluster.algorithms.cflgt`)."""
        ctx = self.ctx
        labels = np.full(len(clients), -1, dtype=np.int64)
        ex = ctx.exchange(clients, state.global_model, rnd, purpose="newcomer")
        if len(ex.clients):
            assert state.mean_updates is not None
            updates = ctx.compared(ex.rows - state.global_model).double()
            dist = torch.cdist(updates, ctx.compared(state.mean_updates).double())
            labels[ex.keep] = dist.argmin(dim=1).numpy()
        return labels
