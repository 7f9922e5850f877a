"""CLoVE: "CLoVE: Personalized Federated Learning through Clustering of Loss Vector
Embeddings" (Nokia Bell Labs and Northwestern University, arXiv:2506.22427, 2025),
the algorithm as its abstract and its introductory figure describe it (the full text
and the authors' repository
github.com/Nokia-Bell-Labs/Loss-Vector-based-Clustered-Federated-Learning could not
be read here; section and equation numbers are not given because we could not
check them).

The server holds K cluster models θ_1..θ_K. Every round, each selected client i
evaluates all K models on its training data and uploads its **loss vector**
L_i = (F_i(θ_1), ..., F_i(θ_K)) -- its embedding. The server clusters the loss
vectors into K groups (k-means, k-means++ seeding), because clients of one data
distribution have similar losses on every model while clients of different ones
differ on at least one, even when all of them prefer the same model (the paper's
introductory figure: IFCA, which lets every client pick its argmin model, puts both
groups on one model; their loss vectors still separate). Each group is then matched to a
distinct model and its members train that model; the server averages per
cluster (the cluster-model machinery of :mod:`fedcluster.algorithms.cluster_models`:
per-cluster FedAvg, rejected uploads, repair, weight sharing).

Matching groups to models: a group g and a model k cost the mean loss of g's
members on θ_k, and the groups take distinct models minimising the total cost
(the Hungarian method, ``scipy.optimize.linear_sum_assignment``). On the
paper's figure example (losses 1.0 and 5.1 for the first group, 2.1 and 3.5 for
the second) this gives the first group θ_1 and the second θ_2, the separation the
paper describes; it is our reading of that example, not the paper's stated rule.

The losses are each client's mean loss on all its training data (``batches:
all``, the F_i(θ_k) of the paper) or on one mini-batch (``one``, cheaper). Unlike
IFCA's decision query, the vector leaves the device: it is counted in
``bytes_up`` (K floats per client) and released under local DP
(:data:`~fedcluster.engine.client_computations.LOSS_VECTORS`). The choice
happens on the server, so ``choice_on_device`` is refused.

Diagnostics: ``clove/silhouette``, the silhouette of the round's grouping of the
loss vectors (Euclidean), and ``clove/groups``, the number of groups formed. A
silhouette below ``warn_silhouette`` after the first ``warmup_rounds`` rounds is
logged as a warning once per run: the loss vectors then show no cluster
structure, and the grouping is arbitrary. The silhouette is a weak signal on
small federations: 12 clients of one group gave 0.33-0.56 over 15 rounds in our
runs, 4 rotation groups 0.25-0.5 in the first 5 rounds and 0.6-0.85 once found;
the default bound catches only loss vectors without any structure.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field
from scipy.optimize import linear_sum_assignment
from sklearn.metrics import silhouette_score

from fedcluster.algorithms.base import Context, log, register
from fedcluster.algorithms.cluster_models import (
    Choice,
    ClusterModelAlgorithm,
    ClusterModelParams,
    ClusterModelState,
)
from fedcluster.clustering.methods import kmeans_pp
from fedcluster.engine.client_computations import LOSS_VECTORS
from fedcluster.errors import ConfigError
from fedcluster.protocol.computation import Request
from fedcluster.rng import derive_seed


class CLoVEParams(ClusterModelParams):
    batches: Literal["one", "all"] = Field(
        "all", description="loss on all local training data (F_i of the paper) or one batch"
    )
    n_init: int = Field(10, ge=1, description="k-means restarts per round")
    warn_silhouette: float = Field(
        0.25, ge=-1.0, le=1.0, description="warn when the grouping's silhouette stays below this"
    )
    warmup_rounds: int = Field(3, ge=0, description="rounds before the silhouette warning")


def group_loss_vectors(losses: np.ndarray, k: int, seed: int, n_init: int = 10) -> np.ndarray:
    """The groups [n] (0..k'-1, k' = min(k, distinct vectors)) of the loss vectors
    ``losses`` [n, K] by k-means with k-means++ seeding (``random_state`` ``seed``)."""
    distinct = len(np.unique(losses, axis=0))
    return kmeans_pp(losses, min(k, distinct), random_state=seed, n_init=n_init)


def match_groups_to_models(losses: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """The model [n_groups] each group takes: distinct models minimising the sum over
    groups of the members' mean loss on their model (Hungarian method)."""
    n_groups = int(groups.max()) + 1
    cost = np.stack([losses[groups == g].mean(axis=0) for g in range(n_groups)])
    rows, cols = linear_sum_assignment(cost)
    model = np.empty(n_groups, dtype=np.int64)
    model[rows] = cols
    return model


@register
class CLoVE(ClusterModelAlgorithm[CLoVEParams]):
    """CLoVE: k-means of the clients' loss vectors over the K cluster models."""

    name = "clove"
    Params = CLoVEParams

    def __init__(self, params: CLoVEParams, ctx: Context) -> None:
        if params.choice_on_device:
            raise ConfigError(
                "clove.choice_on_device: CLoVE groups the clients on the server "
                "(k-means of their loss vectors); the device cannot choose alone"
            )
        super().__init__(params, ctx)
        self._warned = False

    def choice_batches(self) -> str:
        return self.params.batches

    def choose(self, state: ClusterModelState, rnd: int, selected: np.ndarray) -> Choice:
        request = Request(
            shared={"models": state.models},
            settings={
                "train": self.ctx.train,
                "round": rnd,
                "purpose": "loss-vector",
                "batches": self.params.batches,
            },
            tied=self.tied({"models": state.models}),
        )
        replies = self.ctx.ask(LOSS_VECTORS, selected, request, rnd)
        if not len(replies.clients):
            return Choice(replies.clients, np.zeros(0, dtype=np.int64))
        losses = replies["losses"].double().numpy()
        seed = derive_seed(self.ctx.seed, "clove/kmeans", rnd) % 2**32
        groups = group_loss_vectors(losses, self.params.n_clusters, seed, self.params.n_init)
        clusters = match_groups_to_models(losses, groups)[groups]
        return Choice(replies.clients, clusters, self.report(losses, groups, rnd))

    def report(self, losses: np.ndarray, groups: np.ndarray, rnd: int) -> dict[str, float]:
        """The round's diagnostics (module docstring), warning once on a flat grouping."""
        n_groups = int(groups.max()) + 1
        ok = 2 <= n_groups < len(groups)
        score = float(silhouette_score(losses, groups)) if ok else float("nan")
        low = not score >= self.params.warn_silhouette  # NaN: one group, or one per client
        if low and rnd > self.params.warmup_rounds and not self._warned:
            self._warned = True
            log.warning(
                "clove round %d: the clients' loss vectors show no cluster structure "
                "(silhouette %.3f of %d groups); the grouping is arbitrary",
                rnd,
                score,
                n_groups,
            )
        return {"clove/silhouette": score, "clove/groups": float(n_groups)}
