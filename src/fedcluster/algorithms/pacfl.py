"""PACFL: Vahidian, Morafah, Wang, Kungurtsev, Chen, Shah, Lin, "Efficient distribution
similarity identification in clustered federated learning via principal angles between
client data subspaces", AAAI 2023 (Alg. 1; reference code github.com/MMorafah/PACFL).

One-shot clustering before any training, from the clients' data alone:

1. every reachable client computes a truncated SVD of its training data matrix
   D_k = [x_1 ... x_n] (each column a flattened sample) and uploads the first
   ``n_basis`` = p left singular vectors U_p^k (Alg. 1 line 3). With
   ``per_class`` (the reference code's ``main_pacfl.py``, label skew) the SVD is
   taken per label and the p vectors of every label are stacked, U^k = [f, p·C];
   a label the client lacks travels as zero columns, so every upload has the same
   shape (counted in ``bytes_up`` all the same);
2. the server forms the proximity matrix A of principal angles between the
   clients' subspaces (Sec. 3): ``proximity="smallest"`` is eq. 2, the smallest
   principal angle Θ_1(U^i, U^j); ``"sum"`` adds all min(rank) principal angles
   (the summed-angle variant the paper discusses beside eq. 2). Angles are in
   degrees, as the reference code's threshold. The reference code itself scores
   min_{a,b} arccos((U^iᵀU^j)_{ab}) over single basis vectors, which depends on the
   arbitrary sign of each singular vector; principal angles do not;
3. agglomerative hierarchical clustering of A (``linkage``, reference default
   average) merges clusters while their linkage distance is below
   ``threshold`` (the reference's ``cluster_alpha``), or is cut at
   ``n_clusters`` if given: the number of clusters is found, not given;
4. every round, each cluster runs FedAvg with its members among the selected
   clients (Alg. 1 lines 6-12), every cluster model starting from the shared
   initial model. Training starts in the clustering round itself (the
   clustering needs no model).

Newcomers (the paper's Sec. 4.4, "unseen clients"): a client that was not
clustered uploads its subspace when first selected and joins the cluster with
the smallest mean proximity to its members (the average linkage of step 3);
it then trains with that cluster in the same round.

Local DP: the subspace is a direct function of the raw data (the first
singular vector of a label is close to its mean image), so it is *released*
under client-level local DP like CFLGT's trajectory
(:func:`fedcluster.privacy.mechanisms.release_vectors`: clipped, Gaussian noise); the server
re-orthonormalises the noisy vectors (post-processing). Record-level DP has no
per-sample sensitivity for it and is refused by the ledger.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from fedcluster.algorithms.base import AlgorithmParams, RoundOutput, log, register
from fedcluster.algorithms.cflgt import OneShotClustering, OneShotState
from fedcluster.clustering.methods import Linkage, hierarchical
from fedcluster.engine.client_computations import vector_release
from fedcluster.protocol.client_side import ClientContext
from fedcluster.protocol.computation import (
    ClientComputation,
    Payload,
    ReplyField,
    Request,
    register_computation,
)

RANK_TOLERANCE = 1e-6
"""Singular values below this share of the largest span no direction of a basis
(the zero columns of labels a client lacks)."""

ANGLE_CHUNK = 16
"""Clients whose principal angles to all others are computed at a time."""


def data_subspace(
    x: torch.Tensor, y: torch.Tensor, n_basis: int, n_classes: int | None
) -> torch.Tensor:
    """The first ``n_basis`` left singular vectors of the data matrix Xᵀ [f, n] (float32 [f, p]).

    With ``n_classes`` the SVD is taken per label and the bases stacked [f, p·C]
    (zero columns for a missing label, or where a label has fewer than p samples).
    """
    rows = x.reshape(len(x), -1).double()
    f = rows.shape[1]
    groups = [rows] if n_classes is None else [rows[y == c] for c in range(n_classes)]
    out = torch.zeros(f, n_basis * len(groups), dtype=torch.float64)
    for g, data in enumerate(groups):
        if len(data) == 0:
            continue
        u = torch.linalg.svd(data.T, full_matrices=False)[0][:, :n_basis]
        out[:, g * n_basis : g * n_basis + u.shape[1]] = u
    return out.float()


def orthonormal_bases(bases: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """Orthonormal bases of the spans of ``bases`` [m, f, r] (float64, zero-padded to the
    largest rank) and each span's rank [m]."""
    u, s, _ = torch.linalg.svd(bases.double(), full_matrices=False)
    keep = s > RANK_TOLERANCE * s[:, :1].clamp_min(torch.finfo(torch.float64).tiny)
    return u * keep.unsqueeze(1), keep.sum(dim=1).numpy()


def principal_angles(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Principal angles (radians, ascending) between the spans of the orthonormal,
    zero-padded bases ``a`` [m, f, r] and ``b`` [n, f, r]: [m, n, r] (Björck & Golub
    1973: the cosines are the singular values of aᵀb). A pair's angles beyond the
    smaller rank are padding (π/2)."""
    chunks = [  # a chunk of rows of a at a time: [m, n, r, r] products are never held at once
        torch.linalg.svdvals(torch.einsum("ifr,jfs->ijrs", a[lo : lo + ANGLE_CHUNK], b))
        for lo in range(0, len(a), ANGLE_CHUNK)
    ]
    cos = torch.cat(chunks) if chunks else torch.empty(0, len(b), b.shape[-1], dtype=b.dtype)
    return torch.arccos(cos.clamp(0.0, 1.0))


def proximity_matrix(
    a: torch.Tensor, rank_a: np.ndarray, b: torch.Tensor, rank_b: np.ndarray, rule: str
) -> np.ndarray:
    """PACFL's proximity [m, n] in degrees: the smallest principal angle (eq. 2) or the
    sum of the min(rank) principal angles of each pair."""
    angles = torch.rad2deg(principal_angles(a, b))
    if rule == "smallest":
        return angles[..., 0].numpy()
    pairs = np.minimum.outer(rank_a, rank_b)
    used = torch.arange(angles.shape[-1]) < torch.as_tensor(pairs).unsqueeze(-1)
    return (angles * used).sum(dim=-1).numpy()


def _subspace(client: ClientContext, request: Request) -> Payload:
    s = request.settings
    n_classes = int(s["n_classes"]) if s["per_class"] else None
    return {"basis": data_subspace(client.x_train, client.y_train, int(s["n_basis"]), n_classes)}


def _basis_shape(request: Request) -> tuple[int, ...]:
    s = request.settings
    return (
        int(s["n_features"]),
        int(s["n_basis"]) * (int(s["n_classes"]) if s["per_class"] else 1),
    )


SUBSPACE = register_computation(
    ClientComputation(
        name="pacfl-subspace",
        reply={"basis": ReplyField(_basis_shape)},
        run_one_client=_subspace,
        privacy="release",
        release=vector_release("basis", "pacfl"),
    )
)
"""PACFL's client computation (Alg. 1 line 3): the first p left singular vectors of
the client's training data (per label with ``per_class``)."""


class PACFLParams(AlgorithmParams):
    n_basis: int = Field(
        5, ge=1, description="p: left singular vectors per client (per label with per_class)"
    )
    per_class: bool = Field(
        True, description="SVD per label and stack the bases (reference code), or of all data"
    )
    proximity: Literal["smallest", "sum"] = Field(
        "smallest", description="smallest principal angle (eq. 2) or the sum of all of them"
    )
    linkage: Linkage = Field("average", description="hierarchical clustering linkage")
    threshold: float = Field(
        5.0, gt=0.0, description="merge while the linkage distance (degrees) is below this"
    )
    n_clusters: int | None = Field(
        None, ge=1, description="cut at this many clusters instead of at the threshold"
    )


@dataclass
class PACFLState(OneShotState):
    bases: torch.Tensor | None = None
    """The clustered clients' orthonormal bases [m, f, r] (place newcomers)."""
    ranks: np.ndarray | None = None
    members: np.ndarray | None = None
    """The clients whose bases are kept, in order."""
    proximity: np.ndarray | None = None
    """The proximity matrix A of the clustering [m, m] (degrees)."""


@register
class PACFL(OneShotClustering[PACFLParams, PACFLState]):
    """PACFL (Vahidian et al. 2023): principal angles between data subspaces, one-shot
    hierarchical clustering, per-cluster FedAvg."""

    name = "pacfl"
    Params = PACFLParams
    StateType = PACFLState

    def run_round(
        self, state: PACFLState, rnd: int, selected: np.ndarray
    ) -> RoundOutput[PACFLState]:
        """The clustering round (first round, or until a subspace is accepted) also trains."""
        if not self.clustered(state):
            state, _ = self.clustering_round(state, rnd)
        loss = float("nan")
        if self.clustered(state):
            state, loss = self.clustered_round(state, rnd, selected)
        return RoundOutput(state, loss, self.clustering_report(state))

    def subspaces(
        self, clients: np.ndarray, rnd: int
    ) -> tuple[np.ndarray, torch.Tensor, np.ndarray]:
        """The clients upload their bases: accepted ids, orthonormal bases and ranks."""
        ctx = self.ctx
        p = self.params
        fed = ctx.federation
        settings = {
            "n_basis": p.n_basis,
            "per_class": p.per_class,
            "n_classes": fed.n_classes,
            "n_features": int(np.prod(fed.input_shape)),
            "round": rnd,
        }
        replies = ctx.ask(SUBSPACE, clients, Request(settings=settings), rnd)
        bases, ranks = orthonormal_bases(replies["basis"])
        return replies.clients, bases, ranks

    def cluster_clients(self, state: PACFLState, rnd: int) -> tuple[PACFLState, np.ndarray, float]:
        p = self.params
        labels = np.full(self.ctx.n_clients, -1, dtype=np.int64)
        clients, bases, ranks = self.subspaces(self.ctx.available_clients(), rnd)
        if not len(clients):
            log.warning("pacfl: no subspace accepted; clustering again next round")
            return state, labels, float("nan")
        proximity = proximity_matrix(bases, ranks, bases, ranks, p.proximity)
        proximity = (proximity + proximity.T) / 2.0
        np.fill_diagonal(proximity, 0.0)
        labels[clients] = hierarchical(
            proximity,
            n_clusters=None if p.n_clusters is None else min(p.n_clusters, len(clients)),
            distance_threshold=None if p.n_clusters is not None else p.threshold,
            linkage=p.linkage,
        )
        kept = replace(state, bases=bases, ranks=ranks, members=clients, proximity=proximity)
        return kept, labels, float("nan")

    def place_newcomers(self, state: PACFLState, clients: np.ndarray, rnd: int) -> np.ndarray:
        """The cluster of smallest mean proximity to its members (module docstring)."""
        labels = np.full(len(clients), -1, dtype=np.int64)
        accepted, bases, ranks = self.subspaces(clients, rnd)
        if not len(accepted):
            return labels
        assert state.bases is not None and state.ranks is not None and state.members is not None
        prox = proximity_matrix(bases, ranks, state.bases, state.ranks, self.params.proximity)
        member_of = state.assign[state.members]
        k = len(state.models)
        mean = np.stack([prox[:, member_of == c].mean(axis=1) for c in range(k)], axis=1)
        labels[np.isin(clients, accepted)] = mean.argmin(axis=1)
        return labels

    def clustering_report(self, state: PACFLState) -> dict[str, float]:
        """The number of clusters found."""
        return {"n_clusters": float(len(state.models))} if self.clustered(state) else {}
