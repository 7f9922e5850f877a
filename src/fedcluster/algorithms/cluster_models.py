"""Shared machinery of methods that keep K cluster models and let clients choose.

Used by IFCA (Ghosh et al., "An efficient framework for clustered federated
learning", NeurIPS 2020, Alg. 1) and JGL (jgl-joint-gradient-loss-cfl.md,
Alg. 1): the server holds K models [K, d] and each model's last update
Δw_k = w_k^t − w_k^{t−1} (JGL eq. 2); selected clients choose a cluster, train
its model and upload (model, cluster id); the server averages per cluster
(JGL eq. 7, IFCA's model averaging).

Rejected uploads (:meth:`~fedcluster.algorithms.base.Context.exchange`) are
left out: those clients keep their previous cluster id, a cluster none of whose
choosers was accepted keeps its model (and gets Δw_k = 0, as an unchosen
cluster does), and a round without an accepted upload changes nothing.

Dynamic federations (:mod:`fedcluster.scenario`): every selected client
chooses its cluster every round, so a newcomer needs no special rule and a
drifting client re-chooses by itself; the good initializer looks at the
clients present at the start.

Initial models are independent random initialisations, all equal, or IFCA's
"good initializer": the reference code re-draws random initial models until
every cluster is chosen (by loss) by at least ``min_cluster_share`` of the
clients. That re-drawing uses knowledge a real server lacks, so its traffic is
not counted; it is offered to reproduce the papers' baselines.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field

from fedcluster.algorithms.aggregation import cluster_average
from fedcluster.algorithms.base import Algorithm, AlgorithmParams, State, log, weighted_loss
from fedcluster.rng import numpy_rng


class ClusterModelParams(AlgorithmParams):
    n_clusters: int = Field(4, ge=1, description="number of cluster models K")
    init: Literal["random", "same"] = Field(
        "random", description="independent random initial models, or K copies of one"
    )
    min_cluster_share: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="IFCA good initializer: re-draw until each cluster "
        "holds this share of clients (0 = off)",
    )
    max_redraws: int = Field(50, ge=1)
    weighting: Literal["uniform", "samples"] = Field(
        "uniform", description="per-cluster average: uniform (JGL eq. 7) or by sample count"
    )


def argmax_random_ties(score: torch.Tensor, rng: np.random.Generator) -> np.ndarray:
    """Row-wise argmax of ``score`` [n, K], breaking exact ties uniformly at random."""
    s = score.double().numpy()
    best = s.max(axis=1, keepdims=True)
    tie = rng.random(s.shape) * (s == best)
    return tie.argmax(axis=1)


class ClusterModelAlgorithm(Algorithm):
    """Base class: K cluster models, client-side choice, per-cluster averaging."""

    Params = ClusterModelParams

    def init_state(self) -> State:
        k = self.params.n_clusters
        n = self.ctx.n_clients
        return {
            "models": self._initial_models(),
            "delta": torch.zeros(k, self.ctx.dim),
            "assign": np.full(n, -1, dtype=np.int64),
        }

    def _initial_models(self) -> torch.Tensor:
        p = self.params
        ctx = self.ctx
        if p.init == "same":
            return ctx.init_row.unsqueeze(0).repeat(p.n_clusters, 1)
        models = ctx.fresh_rows(p.n_clusters, "cluster-init/0")
        if p.min_cluster_share <= 0.0:
            return models
        clients = np.flatnonzero(ctx.present)
        need = int(np.ceil(p.min_cluster_share * len(clients)))
        for attempt in range(p.max_redraws):
            if attempt:
                models = ctx.fresh_rows(p.n_clusters, f"cluster-init/{attempt}")
            loss, _ = ctx.sim.losses_and_grads(clients, models, ctx.train, 0, "init", False)
            counts = np.bincount(loss.argmin(dim=1).numpy(), minlength=p.n_clusters)
            if counts.min() >= need:
                return models
        log.warning(
            "%s: no initial models gave every cluster %d clients in %d draws; using the last",
            self.name,
            need,
            p.max_redraws,
        )
        return models

    def choose(self, state: State, rnd: int, selected: np.ndarray) -> np.ndarray:
        """Cluster choice of each selected client (a client computation)."""
        raise NotImplementedError

    def run_round(self, state: State, rnd: int, selected: np.ndarray) -> float:
        ctx = self.ctx
        ctx.comm.broadcast(len(selected), floats=self.broadcast_floats())
        choice = self.choose(state, rnd, selected)
        ex = ctx.exchange(selected, state["models"][choice], rnd, ints=self.upload_ints())
        if not len(ex.clients):
            return float("nan")
        choice = choice[ex.keep]
        sizes = ctx.train_sizes[ex.clients]
        weights = sizes if self.params.weighting == "samples" else None
        new = cluster_average(ex.rows, choice, state["models"], weights, ctx.aggregate)
        state["delta"] = new - state["models"]
        state["models"] = new
        state["assign"][ex.clients] = choice
        return weighted_loss(ex.loss, sizes)

    def broadcast_floats(self) -> int:
        """Floats the server sends each selected client per round."""
        return self.params.n_clusters * self.ctx.dim

    def upload_ints(self) -> int:
        """Integers each client uploads besides its model (cluster id, sample count)."""
        return 2 if self.params.weighting == "samples" else 1

    def eval_rows(self, state: State) -> tuple[torch.Tensor, np.ndarray]:
        assign = state["assign"].copy()
        unknown = np.flatnonzero((assign < 0) & self.ctx.present)
        if len(unknown):
            # Never-selected clients pick the model with the lowest loss, as IFCA does
            # (clients not present keep −1: nobody evaluates them).
            loss, _ = self.ctx.sim.losses_and_grads(
                unknown, state["models"], self.ctx.train, 0, "eval-choice", False
            )
            assign[unknown] = loss.argmin(dim=1).numpy()
        return state["models"], assign

    def clusters(self, state: State) -> np.ndarray:
        return state["assign"].copy()

    def tie_rng(self, rnd: int) -> np.random.Generator:
        return numpy_rng(self.ctx.seed, f"{self.name}/ties", rnd)
