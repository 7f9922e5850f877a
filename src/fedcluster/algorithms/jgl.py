"""JGL: joint gradient and loss based clustered FL (jgl-joint-gradient-loss-cfl.md).

Alg. 1 of the paper. Each round the server broadcasts the K cluster models and
their last updates Δw_k = w_k^t − w_k^{t−1} (eq. 2). Each device, on one
mini-batch of its own data, computes for every k the loss L_{i,k} (eq. 1, a
*sum* over the batch) and its gradient ∇L_{i,k}, the similarity S_{i,k}
(eq. 3) and chooses s_i = argmax_k λ·S_{i,k} + (1 − λ)·(−L_{i,k}) (eq. 4). The
choice is made on the device (:func:`choose_clusters` is the client
computation); the device trains the chosen model and uploads (model, s_i);
the server averages per cluster (eq. 7). Sec. II-C's empty-cluster fix gives
every empty cluster one randomly chosen device.

Sign of the similarity. Δw_k points along the *negative* gradient of the
cluster's devices, so a device whose data agrees with cluster k has ∇L_{i,k}
pointing opposite to Δw_k. Eq. 3 as printed, cos(∇L, Δw), would push devices
away from their cluster; the default ``gradient_sign="descent"`` scores
cos(−∇L_{i,k}, Δw_k) and ``"literal"`` reproduces the printed form. Before any
cluster has been updated (Δw_k = 0) the similarity is 0 and the loss decides.
The euclidean alternative of Sec. II-B is S = −‖g − Δw_k‖ with the same sign
convention for g.
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

CLIENT_CHUNK = 16  # clients whose K gradients are held in memory at once


class JGLParams(ClusterModelParams):
    lam: float = Field(0.2, ge=0.0, le=1.0, description="weight λ of the similarity (eq. 4)")
    similarity: Literal["cosine", "euclidean"] = "cosine"
    gradient_sign: Literal["descent", "literal"] = "descent"
    loss_reduction: Literal["sum", "mean"] = Field(
        "sum", description="eq. 1 sums the loss over the mini-batch"
    )
    empty_cluster_fix: bool = True


def jgl_scores(
    loss: torch.Tensor,
    grads: torch.Tensor,
    deltas: torch.Tensor,
    lam: float,
    similarity: str = "cosine",
    gradient_sign: str = "descent",
) -> torch.Tensor:
    """Eq. 4's objective λ·S_{i,k} + (1 − λ)·(−L_{i,k}) for losses [n, K], grads [n, K, d]."""
    g = -grads if gradient_sign == "descent" else grads
    updated = deltas.norm(dim=1) > 0
    if similarity == "cosine":
        num = torch.einsum("nkd,kd->nk", g, deltas)
        den = g.norm(dim=2) * deltas.norm(dim=1).unsqueeze(0)
        sim = torch.where(den > 0, num / den.clamp(min=1e-30), torch.zeros_like(num))
    else:
        sim = -(g - deltas.unsqueeze(0)).norm(dim=2)
    sim = torch.where(updated.unsqueeze(0), sim, torch.zeros_like(sim))
    return lam * sim + (1.0 - lam) * (-loss)


def fix_empty_clusters(choice: np.ndarray, n_clusters: int, rng: np.random.Generator) -> np.ndarray:
    """Sec. II-C: give each empty cluster one random device from a cluster that can spare one."""
    choice = choice.copy()
    for k in range(n_clusters):
        counts = np.bincount(choice, minlength=n_clusters)
        if counts[k] > 0:
            continue
        donors = np.flatnonzero(counts[choice] > 1)
        if len(donors) == 0:
            break
        choice[rng.choice(donors)] = k
    return choice


@register
class JGL(ClusterModelAlgorithm):
    """JGL (Alg. 1): device-side cluster choice from gradient similarity and loss."""

    name = "jgl"
    Params = JGLParams

    def choose(self, state: State, rnd: int, selected: np.ndarray) -> np.ndarray:
        p = self.params
        ctx = self.ctx
        scores = []
        batch = np.minimum(ctx.train_sizes[selected], ctx.train.batch_size)
        for s in range(0, len(selected), CLIENT_CHUNK):
            part = selected[s : s + CLIENT_CHUNK]
            loss, grads = ctx.sim.losses_and_grads(part, state["models"], ctx.train, rnd, "decide")
            if p.loss_reduction == "sum":
                b = torch.as_tensor(batch[s : s + CLIENT_CHUNK], dtype=loss.dtype)
                loss = loss * b.unsqueeze(1)
                grads = grads * b.view(-1, 1, 1)
            scores.append(
                jgl_scores(loss, grads, state["delta"], p.lam, p.similarity, p.gradient_sign)
            )
        rng = self.tie_rng(rnd)
        choice = argmax_random_ties(torch.cat(scores), rng)
        if p.empty_cluster_fix:
            choice = fix_empty_clusters(choice, p.n_clusters, rng)
        return choice

    def broadcast_floats(self) -> int:
        return 2 * self.params.n_clusters * self.ctx.dim  # K models and their last updates
