"""FedGWC: Licciardi, Leo, Fanì, Caputo, Ciccone, "Interaction-Aware Gaussian Weighting
for Clustered Federated Learning", ICML 2025 (arXiv:2502.03340), the method section
(Gaussian rewards, interaction matrix, spectral clustering); reference code
github.com/davedleo/FedGWC, ``agents/servers.py`` (``ServerFedGWC``). Only the paper's
abstract and summary could be read here, so the steps and their constants follow the
reference code, with the departures listed below; section and equation numbers are
not given because we could not check them.

Clients start in one cluster, which trains by FedAvg. Each round, within each cluster
c that may still split:

1. **Gaussian rewards**. The participants' empirical losses ℓ_i give a
   sample-weighted mean μ = Σ n_i ℓ_i / Σ n_i and variance σ² = Σ n_i (ℓ_i − μ)² /
   Σ n_i, and each participant the reward r_i = exp(−(ℓ_i − μ)² / (2σ²)): how typical
   its loss is of the round's population (:func:`gaussian_rewards`).
2. **Interaction matrix**. With α = m/N_c (participants over members), for
   every pair of participants i, j: W_ij ← (1 − α) W_ij + α r_i / Σ_l r_l, an
   exponential average of who is rewarded alongside whom (W starts at 1/N²). The mean
   squared change of the updated entries feeds an exponential average ``mse`` (α
   again, from 1); once it stays below ε for ``patience`` consecutive rounds
   (default ⌈N_c/m⌉, the rounds a member waits to be sampled), the interactions have
   converged and the cluster is examined (:func:`update_interactions`).
3. **Similarity and split**. The rows of W (``compare``), min-max normalised, give
   P_ij = exp(−γ Σ_{l≠i,j} (W_il − W_jl)²) (:func:`interaction_similarity`); spectral
   clustering of P into k = 2..K_max groups (scikit-learn, ``cluster_qr`` labels) is
   scored by the Davies-Bouldin index of the groups in the spectral embedding, and the
   best k is kept if its index is below ``max_davies_bouldin`` (:func:`best_split`).
   K_max = min(``max_split``, ⌊N_c/m⌋): each group should hold about a round's
   participants or more. The groups become clusters, each starting from the parent's
   model with the parent's interactions among its members, and each is examined
   again (recursively) while it holds at least twice its round's participants. A
   cluster with no split restarts its ``mse`` from 1.

Where the paper and the reference code differ, or the code fixes a detail, we follow
the code: the Davies-Bouldin index (initial best 1.0) selects k, up to 4 groups per
split, bounded by N_c/m. One consequence: under full participation (m = N_c) no
cluster ever splits; FedGWC needs partial participation (the paper samples 10
clients per round). The code draws m clients within each cluster; here the runner's
selection is used as it comes, each cluster's m being its participants of the round.
The code compares the clients by W's columns (what the others were rewarded next to
a client); on our test federations (groups of unequal difficulty, 8 of 16 clients a
round) the columns showed no group structure while the rows (each client's own
rewards, per partner) did, so ``compare: rows`` is the default and ``columns`` the
code's choice. The code averages each client's rewards over its S local-step losses
and pads the statistics with Gaussian samples when fewer than 100 clients take part;
here each client uploads the mean loss of its local training (S = 1, 4 bytes counted
with its sample count) and μ, σ² are the participants' own. The paper's
Wasserstein-adjusted score, which weighs a clustering by the clients' class
distributions, is not used to select k: it needs those distributions on the server.

Diagnostics: ``fedgwc/clusters``, ``fedgwc/splits`` (this round), ``fedgwc/mse``
(the smallest of the clusters' mse: compare it with ε), and, when a cluster was
examined, ``fedgwc/davies_bouldin`` (best index found) and
``fedgwc/similarity_spread`` (max − min of P off the diagonal). A spread below 1e-6
means the rewards carried no signal, and an examined cluster of all clients that does
not split means no structure was found: both are logged as warnings, as is an mse that
never falls below ε in 20 times the rounds a client waits to be sampled. ε is not
scale-free: the mse plateaus near α²·Var(r/Σr), so a federation smaller than the
paper's (fewer clients, a larger α) needs a larger ε (1e-3 for 16-32 clients, half
of them a round, in our tests and docs/reproduction.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch
from pydantic import Field
from sklearn.cluster import SpectralClustering
from sklearn.manifold import SpectralEmbedding
from sklearn.metrics import davies_bouldin_score

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
from fedcluster.rng import derive_seed

SETTLE_WAITS = 20
"""Rounds, in units of a client's wait to be sampled, after which FedGWC warns that its
interactions never settled (:meth:`FedGWC.check_settling`)."""

FLAT_SPREAD = 1e-6
"""A similarity matrix whose off-diagonal entries span less than this carries no signal."""


class FedGWCParams(AlgorithmParams):
    gamma: float = Field(4.0, gt=0.0, description="γ of the similarity exp(−γ‖W_i − W_j‖²)")
    eps: float = Field(1e-5, gt=0.0, description="ε: interactions converged when mse < ε")
    patience: int | None = Field(
        None, ge=1, description="rounds below ε before a split (None: ⌈N_c/m⌉ per cluster)"
    )
    max_split: int = Field(4, ge=2, description="most groups one split may form")
    max_davies_bouldin: float = Field(
        1.0, gt=0.0, description="a split is kept only if its Davies-Bouldin index is below"
    )
    compare: Literal["rows", "columns"] = Field(
        "rows",
        description="compare clients by W's rows (their own rewards per partner) or by its "
        "columns (the reference code)",
    )


def gaussian_rewards(losses: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """r_i = exp(−(ℓ_i − μ)² / (2σ²)) with μ, σ² the ``weights``-weighted mean and
    variance of ``losses`` [m] (σ² + 1e-16, so equal losses all get 1)."""
    w = weights / weights.sum()
    mu = float(w @ losses)
    var = float(w @ (losses - mu) ** 2) + 1e-16
    return np.exp(-0.5 * (losses - mu) ** 2 / var)


def update_interactions(
    interactions: np.ndarray, clients: np.ndarray, rewards: np.ndarray, alpha: float
) -> tuple[np.ndarray, float]:
    """W_ij ← (1 − α) W_ij + α r_i / Σ r for the participants ``clients`` [m] (rows and
    columns of ``interactions``); a new matrix and the mean squared change of the m²
    updated entries."""
    block = np.ix_(clients, clients)
    old = interactions[block]
    new = (1.0 - alpha) * old + alpha * (rewards / rewards.sum())[:, None]
    out = interactions.copy()
    out[block] = new
    return out, float(((new - old) ** 2).mean())


def interaction_similarity(perceptions: np.ndarray, gamma: float) -> np.ndarray:
    """P_ij = exp(−γ Σ_{l≠i,j} (V_il − V_jl)²), V the square matrix ``perceptions``
    [n, n] (each client's row) min-max normalised to [0, 1]; P_ii = 0."""
    span = float(perceptions.max() - perceptions.min())
    v = (perceptions - perceptions.min()) / max(span, 1e-8)
    gram = v @ v.T
    norms = np.diag(gram)
    full = norms[:, None] + norms[None, :] - 2.0 * gram  # ‖V_i − V_j‖² over every l
    a = np.diag(v)
    own_i = (a[:, None] - v.T) ** 2  # the l = i term: (V_ii − V_ji)²
    own_j = (v - a[None, :]) ** 2  # the l = j term: (V_ij − V_jj)²
    p = np.exp(-gamma * np.maximum(full - own_i - own_j, 0.0))
    np.fill_diagonal(p, 0.0)
    return p


def best_split(
    similarity: np.ndarray, max_split: int, max_index: float, seed: int
) -> tuple[np.ndarray | None, float]:
    """Spectral clustering of ``similarity`` [n, n] into k = 2..``max_split`` groups
    (at most n − 1); the labels of the k with the lowest Davies-Bouldin index in the
    spectral embedding, if below ``max_index`` (else None), and the lowest index."""
    best_labels, best_index = None, float("inf")
    for k in range(2, min(max_split, len(similarity) - 1) + 1):
        embedding = SpectralEmbedding(
            n_components=k, affinity="precomputed", random_state=seed
        ).fit_transform(similarity)
        labels = SpectralClustering(
            n_clusters=k,
            n_components=k,
            affinity="precomputed",
            assign_labels="cluster_qr",
            random_state=seed,
        ).fit_predict(similarity)
        if len(np.unique(labels)) < 2:
            continue
        index = float(davies_bouldin_score(embedding, labels))
        if index < best_index:
            best_labels, best_index = labels, index
    if best_index >= max_index:
        return None, best_index
    return best_labels, best_index


@dataclass
class FedGWCState(State):
    models: torch.Tensor
    """One model per cluster [C, d]."""
    labels: np.ndarray
    """Each client's cluster [N]."""
    interactions: np.ndarray
    """The interaction matrix W [N, N] (a cluster's block holds its W)."""
    mse: np.ndarray
    """Each cluster's averaged squared change of W [C]."""
    calm: np.ndarray
    """Consecutive rounds each cluster's mse stayed below ε [C]."""


@register
class FedGWC(Algorithm[FedGWCParams, FedGWCState]):
    """FedGWC: Gaussian-reward interactions, recursive spectral splits."""

    name = "fedgwc"
    Params = FedGWCParams
    StateType = FedGWCState

    def __init__(self, params: FedGWCParams, ctx: Context) -> None:
        super().__init__(params, ctx)
        self._examined = False
        self._warned = False

    def init_state(self) -> FedGWCState:
        n = self.ctx.n_clients
        return FedGWCState(
            models=self.ctx.init_row.unsqueeze(0).clone(),
            labels=np.zeros(n, dtype=np.int64),
            interactions=np.full((n, n), 1.0 / n**2),
            mse=np.ones(1),
            calm=np.zeros(1, dtype=np.int64),
        )

    def run_round(
        self, state: FedGWCState, rnd: int, selected: np.ndarray
    ) -> RoundOutput[FedGWCState]:
        ctx = self.ctx
        ex = ctx.exchange(selected, state.models[state.labels[selected]], rnd, ints=2)
        if not len(ex.clients):
            return RoundOutput(state, float("nan"))
        sizes = ctx.train_sizes[ex.clients]
        choice = state.labels[ex.clients]
        models = cluster_average(ex.rows, choice, state.models, sizes, ctx.aggregate)
        state = replace(state, models=models)
        loss = ex.loss.double().numpy()
        report: dict[str, float] = {"fedgwc/splits": 0.0}
        for c in np.unique(choice):
            part = (choice == c) & np.isfinite(loss)
            m = int(part.sum())
            most = min(self.params.max_split, int((state.labels == c).sum()) // max(m, 1))
            if m >= 2 and most >= 2:  # at least twice the round's participants
                state = self.interact(state, int(c), ex.clients[part], loss[part], sizes[part])
                if state.calm[c] >= self.patience(state, int(c), m):
                    state = self.examine(state, int(c), rnd, most, report)
        report["fedgwc/clusters"] = float(len(state.models))
        report["fedgwc/mse"] = float(state.mse.min())
        self.check_settling(state, rnd, len(ex.clients), report)
        return RoundOutput(state, weighted_loss(ex.loss, sizes), report)

    def check_settling(
        self, state: FedGWCState, rnd: int, m: int, report: dict[str, float]
    ) -> None:
        """Warn once if no cluster was examined in ``SETTLE_WAITS`` times the rounds a
        client waits to be sampled: the mse plateaus above ε (its level scales with
        α² and so with the federation), and FedGWC never clusters."""
        if "fedgwc/davies_bouldin" in report:
            self._examined = True
        waited = rnd >= SETTLE_WAITS * int(np.ceil(self.ctx.n_clients / max(m, 1)))
        if waited and not self._examined and not self._warned:
            self._warned = True
            log.warning(
                "fedgwc round %d: the interactions have not settled (smallest mse %.3g, "
                "eps %.3g): no cluster was examined; a larger eps lets FedGWC cluster",
                rnd,
                float(state.mse.min()),
                self.params.eps,
            )

    def patience(self, state: FedGWCState, c: int, m: int) -> int:
        """Rounds of converged interactions before cluster ``c`` is examined."""
        if self.params.patience is not None:
            return self.params.patience
        return int(np.ceil(int((state.labels == c).sum()) / m))

    def interact(
        self,
        state: FedGWCState,
        c: int,
        clients: np.ndarray,
        losses: np.ndarray,
        sizes: np.ndarray,
    ) -> FedGWCState:
        """Steps 1-2 of the module docstring for cluster ``c``'s participants."""
        alpha = len(clients) / int((state.labels == c).sum())
        rewards = gaussian_rewards(losses, sizes.astype(np.float64))
        interactions, change = update_interactions(state.interactions, clients, rewards, alpha)
        mse = state.mse.copy()
        mse[c] = (1.0 - alpha) * mse[c] + alpha * change
        calm = state.calm.copy()
        calm[c] = calm[c] + 1 if mse[c] < self.params.eps else 0
        return replace(state, interactions=interactions, mse=mse, calm=calm)

    def examine(
        self, state: FedGWCState, c: int, rnd: int, most: int, report: dict[str, float]
    ) -> FedGWCState:
        """Step 3: split cluster ``c`` into at most ``most`` groups if its interactions
        show groups."""
        p = self.params
        members = np.flatnonzero(state.labels == c)
        block = state.interactions[np.ix_(members, members)]
        similarity = interaction_similarity(block if p.compare == "rows" else block.T, p.gamma)
        off = similarity[~np.eye(len(members), dtype=bool)]
        spread = float(off.max() - off.min())
        seed = derive_seed(self.ctx.seed, "fedgwc/spectral", rnd, c) % 2**32
        groups, index = best_split(similarity, most, p.max_davies_bouldin, seed)
        report["fedgwc/davies_bouldin"] = index
        report["fedgwc/similarity_spread"] = spread
        if spread < FLAT_SPREAD:
            log.warning(
                "fedgwc round %d: cluster %d's interaction similarities are flat (spread %.2g): "
                "the Gaussian rewards carry no signal",
                rnd,
                c,
                spread,
            )
        if groups is None:
            if len(state.models) == 1:
                log.warning(
                    "fedgwc round %d: no cluster structure in the interactions of all clients "
                    "(best Davies-Bouldin %.3f, needed < %.3f); they stay one cluster",
                    rnd,
                    index,
                    p.max_davies_bouldin,
                )
            mse = state.mse.copy()
            mse[c] = 1.0
            return replace(state, mse=mse)
        report["fedgwc/splits"] += 1.0
        log.info("fedgwc round %d: cluster %d split into %d", rnd, c, int(groups.max()) + 1)
        labels = state.labels.copy()
        ids = [c] + list(range(len(state.models), len(state.models) + int(groups.max())))
        for g, cluster in enumerate(ids):
            labels[members[groups == g]] = cluster
        extra = len(ids) - 1
        mse = np.concatenate([state.mse, np.ones(extra)])
        mse[c] = 1.0
        calm = np.concatenate([state.calm, np.zeros(extra, dtype=np.int64)])
        calm[c] = 0
        models = torch.cat([state.models, state.models[c].expand(extra, -1)])
        return replace(
            state,
            models=models,
            labels=labels,
            mse=mse,
            calm=calm,
        )

    def eval_rows(self, state: FedGWCState) -> tuple[torch.Tensor, np.ndarray]:
        return state.models, state.labels

    def clusters(self, state: FedGWCState) -> np.ndarray:
        return state.labels.copy()
