"""CFL-GP: Kim, Kim, de Veciana, "Clustered Federated Learning via Gradient-based
Partitioning", ICML 2024 (PMLR 235), the CFL-GP algorithm (gradient profile,
spectral clustering and matching); reference code
github.com/Heasung-Kim/clustered-federated-learning-via-gradient-based-partitioning,
``learning_agent/central_unit.py`` (``run_CFLGP``) and ``learning_agent/utils.py``
(``spectral_clustering_and_matching``). The paper's abstract and the authors'
summary could be read here, not its full text: the steps and constants follow the
reference code (section and equation numbers are not given because we could not
check them).

The server keeps K models θ_1..θ_K and a **gradient profile** of every client: K
blocks, block k the client's accumulated gradient information at θ_k. Every
``period`` rounds (a clustering round, up to round ``stop_after``):

1. the server broadcasts one model, θ_k with k = ⌊(t − 1)/period⌋ mod K: the models
   take turns (``rotate``), so after K clustering rounds every block holds
   information. The reference code sizes the profile and its averaging weight for
   this turn-taking, but as published keeps k = 1 (its ``criterion_model_index``
   never changes); ``rotate: false`` does the same. Each
   selected client trains θ_k locally and uploads its update θ_k − θ_i' (the learning
   rate times the sum of its local gradients; the reference code's ``model_averaging``
   protocol, which equals one gradient step's when the local training is one step);
2. the client's block k becomes the cumulative average of its updates at θ_k:
   g_ik ← (1 − β) g_ik + β Δ_i, β = 1/(number of earlier updates in that block + 1)
   (the reference code's β = 1/(⌊(t+1)/(K·period)⌋ + 1) is this count under full
   participation; the per-client count keeps the average exact when clients skip
   rounds);
3. **spectral clustering** (the reference code's ``spectral_clustering_and_matching``): G, the
   profiles as columns [K·p, n], is reduced to the top-K left singular vectors,
   G̃ = P_Kᵀ G (each client a point in R^K), and G̃'s columns are clustered by
   k-means (k-means++ seeding); :func:`profile_embedding`, :func:`profile_partition`;
4. **matching**: the new clusters are renumbered to agree with the previous
   assignment on as many clients as possible (the reference code tries every
   permutation; the Hungarian method on the contingency table gives the same
   optimum, :func:`match_labels`).

Partial participation: the reference code profiles every client in every
clustering round. When clients skip clustering rounds and the models take turns,
their profiles are filled in different blocks, and the empty blocks, not the data,
then dominate the distances (a warning says so); ``rotate: false`` keeps every
profile in one block and clusters correctly with any participation.

Every round, each selected client then trains the model of its cluster, and the
server averages each cluster's uploads (weighted by sample count). Before the first
clustering every client uses θ_1. The clients clustered are those with a profile
(profiled at least once); the others keep their cluster.

Projection: ``profile_coordinates`` keeps a random subset of that many coordinates
of each update (the reference code's ``use_reduced_G``, which keeps 1 % of them),
drawn once from the seed; None keeps all trainable parameters. The profile holds
n·K·p floats, at most 1 GiB (``PROFILE_BYTES``; a larger one is a configuration
error that names the number of coordinates that fit).

Diagnostics: ``cflgp/block`` (the profiled model of a clustering round) and
``cflgp/gap`` = σ_K/σ_{K+1}, the ratio of G's K-th to (K+1)-th singular value: K
clear clusters make it large. A ratio below ``warn_gap`` in the last clustering
round is logged as a warning: the profile then shows no K-cluster structure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch
from pydantic import Field
from scipy.optimize import linear_sum_assignment

from fedcluster.algorithms.aggregation import cluster_average
from fedcluster.algorithms.base import (
    Algorithm,
    AlgorithmParams,
    Context,
    RoundOutput,
    State,
    log,
    register,
    weighted_loss,
)
from fedcluster.algorithms.cluster_count import AUTO_HELP
from fedcluster.clustering.methods import kmeans_pp
from fedcluster.errors import ConfigError
from fedcluster.rng import derive_seed, numpy_rng

PROFILE_BYTES = 2**30
"""The largest gradient profile (n·K·p float32) a run may keep in its state."""


class CFLGPParams(AlgorithmParams):
    n_clusters: int = Field(4, ge=1, description="number of cluster models K" + AUTO_HELP)
    period: int = Field(2, ge=1, description="rounds between clustering rounds (reference: 2)")
    stop_after: int = Field(10, ge=1, description="no clustering after this round (reference: 10)")
    profile_coordinates: int | None = Field(
        None, ge=1, description="random coordinates kept of each update (None: all)"
    )
    weighting: Literal["uniform", "samples"] = Field(
        "samples", description="per-cluster average: uniform or by sample count"
    )
    rotate: bool = Field(
        True, description="profile at each model in turn (False: always θ_1, the published code)"
    )
    n_init: int = Field(10, ge=1, description="k-means restarts per clustering")
    warn_gap: float = Field(
        1.2, ge=1.0, description="warn when the last clustering's σ_K/σ_{K+1} is below this"
    )


def profile_embedding(profiles: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each client's point P_Kᵀ g_i [n, k] and the singular values of G, from the
    profiles ``profiles`` [n, D] (G = profilesᵀ; P_K its top-k left singular vectors).

    With profiles = U S Vᵀ, G = V S Uᵀ and P_Kᵀ G = S_K U_Kᵀ: the points are the rows
    of U_K S_K (signs of the columns as the SVD returns them)."""
    u, s, _ = torch.linalg.svd(profiles.double(), full_matrices=False)
    k = min(k, len(s))
    return (u[:, :k] * s[:k]).numpy(), s.numpy()


def profile_partition(
    profiles: torch.Tensor, k: int, seed: int, n_init: int = 10
) -> tuple[np.ndarray, np.ndarray]:
    """k-means (k-means++, ``random_state`` ``seed``) of the spectral embedding of the
    profiles [n, D] (:func:`profile_embedding`): labels [n] and G's singular values."""
    points, singular = profile_embedding(profiles, k)
    distinct = len(np.unique(points, axis=0))
    return kmeans_pp(points, min(k, distinct), random_state=seed, n_init=n_init), singular


def match_labels(new: np.ndarray, old: np.ndarray, k: int) -> np.ndarray:
    """``new`` labels (0..k-1) renamed so that as many as possible equal ``old``."""
    table = np.zeros((k, k), dtype=np.int64)
    np.add.at(table, (new, old), 1)
    rows, cols = linear_sum_assignment(-table)
    rename = np.empty(k, dtype=np.int64)
    rename[rows] = cols
    return rename[new]


@dataclass
class CFLGPState(State):
    models: torch.Tensor
    """The K cluster models [K, d]."""
    labels: np.ndarray
    """Each client's cluster [N]."""
    profiles: torch.Tensor
    """The gradient profiles [N, K, p] (block k: accumulated updates at θ_k)."""
    counts: np.ndarray
    """Updates averaged into each block [N, K]."""


@register
class CFLGP(Algorithm[CFLGPParams, CFLGPState]):
    """CFL-GP: periodic spectral clustering of accumulated gradient profiles."""

    name = "cflgp"
    Params = CFLGPParams
    StateType = CFLGPState
    cluster_count = "n_clusters"

    def __init__(self, params: CFLGPParams, ctx: Context) -> None:
        super().__init__(params, ctx)
        width = ctx.compared(ctx.init_row.unsqueeze(0)).shape[1]
        self.coordinates: torch.Tensor | None = None
        """The coordinates kept of each update (``profile_coordinates``), or None."""
        if params.profile_coordinates is not None and params.profile_coordinates < width:
            pick = numpy_rng(ctx.seed, "cflgp/coordinates").choice(
                width, size=params.profile_coordinates, replace=False
            )
            self.coordinates = torch.as_tensor(np.sort(pick))
        self.width = width if self.coordinates is None else len(self.coordinates)
        self._warned_coverage = False
        floats = ctx.n_clients * params.n_clusters * self.width
        if floats * 4 > PROFILE_BYTES:
            fit = max(1, PROFILE_BYTES // (4 * ctx.n_clients * params.n_clusters))
            raise ConfigError(
                f"cflgp.profile_coordinates: the gradient profile would hold {floats:,} floats "
                f"({floats * 4 / 2**30:.1f} GiB) for {ctx.n_clients} clients, "
                f"{params.n_clusters} models and {self.width:,} coordinates; keep at most "
                f"profile_coordinates: {fit} (the reference code keeps 1 %)"
            )

    def init_state(self) -> CFLGPState:
        k, n = self.params.n_clusters, self.ctx.n_clients
        return CFLGPState(
            models=self.ctx.fresh_rows(k, "cflgp/init"),
            labels=np.zeros(n, dtype=np.int64),
            profiles=torch.zeros(n, k, self.width),
            counts=np.zeros((n, k), dtype=np.int64),
        )

    def clustering_round(self, rnd: int) -> bool:
        p = self.params
        return rnd <= p.stop_after and (rnd - 1) % p.period == 0

    def run_round(
        self, state: CFLGPState, rnd: int, selected: np.ndarray
    ) -> RoundOutput[CFLGPState]:
        ctx = self.ctx
        report: dict[str, float] = {}
        if self.clustering_round(rnd):
            state, report = self.recluster(state, rnd, selected)
        ints = int(self.params.weighting == "samples")  # the sample count; the server assigns
        ex = ctx.exchange(selected, state.models[state.labels[selected]], rnd, ints=ints)
        if not len(ex.clients):
            return RoundOutput(state, float("nan"), report)
        sizes = ctx.train_sizes[ex.clients]
        weights = sizes if self.params.weighting == "samples" else None
        choice = state.labels[ex.clients]
        models = cluster_average(ex.rows, choice, state.models, weights, ctx.aggregate)
        return RoundOutput(replace(state, models=models), weighted_loss(ex.loss, sizes), report)

    def recluster(
        self, state: CFLGPState, rnd: int, selected: np.ndarray
    ) -> tuple[CFLGPState, dict[str, float]]:
        """Steps 1-4 of the module docstring: profile at θ_k, cluster, match."""
        ctx = self.ctx
        p = self.params
        block = ((rnd - 1) // p.period) % p.n_clusters if p.rotate else 0
        start = state.models[block]
        ex = ctx.exchange(selected, start, rnd, purpose="profile")
        report = {"cflgp/block": float(block)}
        if not len(ex.clients):
            return state, report
        update = ctx.compared(start.unsqueeze(0) - ex.rows)
        if self.coordinates is not None:
            update = update[:, self.coordinates]
        profiles = state.profiles.clone()
        counts = state.counts.copy()
        beta = torch.as_tensor(1.0 / (counts[ex.clients, block] + 1.0), dtype=torch.float32)
        old = profiles[ex.clients, block]
        profiles[ex.clients, block] = old + beta[:, None] * (update.float() - old)
        counts[ex.clients, block] += 1
        profiled = np.flatnonzero(counts.sum(axis=1) > 0)
        covered = counts[profiled] > 0
        if (covered != covered[0]).any() and not self._warned_coverage:
            self._warned_coverage = True
            log.warning(
                "cflgp round %d: the profiled clients were profiled at different models "
                "(partial participation with rotate: true); their empty blocks distort the "
                "clustering: use rotate: false, or every client in the clustering rounds",
                rnd,
            )
        seed = derive_seed(ctx.seed, "cflgp/kmeans", rnd) % 2**32
        new, singular = profile_partition(
            profiles[profiled].reshape(len(profiled), -1), p.n_clusters, seed, p.n_init
        )
        labels = state.labels.copy()
        labels[profiled] = match_labels(new, state.labels[profiled], p.n_clusters)
        k = p.n_clusters
        below = singular[k] if len(singular) > k else 0.0
        gap = float(singular[k - 1] / below) if below > 0.0 else float("inf")
        report["cflgp/gap"] = gap
        last = rnd + p.period > p.stop_after
        if last and gap < p.warn_gap:
            log.warning(
                "cflgp round %d: the gradient profile shows no %d-cluster structure "
                "(sigma_K/sigma_K+1 = %.3f < %.3f); the clusters are arbitrary",
                rnd,
                k,
                gap,
                p.warn_gap,
            )
        new_state = replace(state, labels=labels, profiles=profiles, counts=counts)
        return new_state, report

    def eval_rows(self, state: CFLGPState) -> tuple[torch.Tensor, np.ndarray]:
        return state.models, state.labels

    def clusters(self, state: CFLGPState) -> np.ndarray:
        return state.labels.copy()
