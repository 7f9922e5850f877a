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

Both similarities need only ‖∇L_{i,k}‖² and ⟨∇L_{i,k}, Δw_k⟩, which the
simulator computes without forming the K gradients of d floats per device
(:meth:`~fedcluster.engine.simulator.Simulator.losses_and_gradient_products`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from pydantic import Field

from fedcluster.algorithms.base import register
from fedcluster.algorithms.cluster_models import (
    Choice,
    ClusterModelAlgorithm,
    ClusterModelParams,
    State,
    argmax_random_ties,
)
from fedcluster.engine.client_computations import DECISION_EXEMPTION
from fedcluster.engine.computation import (
    ClientComputation,
    Payload,
    ReplyField,
    Request,
    register_computation,
)

if TYPE_CHECKING:
    from fedcluster.engine.simulator import Simulator


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
    grad_sq: torch.Tensor,
    grad_dot: torch.Tensor,
    delta_sq: torch.Tensor,
    lam: float,
    similarity: str = "cosine",
    gradient_sign: str = "descent",
) -> torch.Tensor:
    """Eq. 4's objective λ·S_{i,k} + (1 − λ)·(−L_{i,k}) from gradient products.

    ``loss`` [n, K] is L_{i,k}; ``grad_sq`` [n, K] = ‖∇L_{i,k}‖²; ``grad_dot``
    [n, K] = ⟨∇L_{i,k}, Δw_k⟩; ``delta_sq`` [K] = ‖Δw_k‖². With g = ∓∇L (the
    sign convention, module docstring) the cosine similarity is ⟨g, Δw⟩ /
    (‖g‖‖Δw‖) and the euclidean one −‖g − Δw‖ = −√(‖g‖² − 2⟨g, Δw⟩ + ‖Δw‖²).
    """
    dot = (-grad_dot if gradient_sign == "descent" else grad_dot).double()
    grad_sq, delta_sq = grad_sq.double(), delta_sq.double().unsqueeze(0)
    if similarity == "cosine":
        den = grad_sq.sqrt() * delta_sq.sqrt()
        sim = torch.where(den > 0, dot / den.clamp(min=1e-300), torch.zeros_like(dot))
    else:
        sim = -(grad_sq - 2.0 * dot + delta_sq).clamp(min=0.0).sqrt()
    sim = torch.where(delta_sq > 0, sim, torch.zeros_like(sim))
    return lam * sim + (1.0 - lam) * (-loss.double())


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


def _n_models(request: Request) -> tuple[int, ...]:
    return (request.shared["models"].shape[0],)


def _gradient_products(sim: Simulator, clients: np.ndarray, request: Request) -> Payload:
    s = request.settings
    loss, sq, dot = sim.losses_and_gradient_products(
        clients,
        request.shared["models"],
        request.shared["directions"],
        s["train"],
        s["round"],
        s.get("purpose", "decide"),
    )
    return {"losses": loss, "sq": sq, "dot": dot}


GRADIENT_PRODUCTS = register_computation(
    ClientComputation(
        name="jgl-products",
        reply={
            "losses": ReplyField(_n_models, counted=False),
            "sq": ReplyField(_n_models, counted=False, dtype=torch.float64),
            "dot": ReplyField(_n_models, counted=False, dtype=torch.float64),
        },
        batched_run=_gradient_products,
        exempt_because=DECISION_EXEMPTION,
    )
)
"""JGL's device-side quantities (eq. 1, 3): for each received model k, the loss L_{i,k}
on one mini-batch, ‖∇L_{i,k}‖² and ⟨∇L_{i,k}, Δw_k⟩ with the received last update Δw_k."""


@register
class JGL(ClusterModelAlgorithm):
    """JGL (Alg. 1): device-side cluster choice from gradient similarity and loss."""

    name = "jgl"
    Params = JGLParams

    def choose(self, state: State, rnd: int, selected: np.ndarray) -> Choice:
        p = self.params
        ctx = self.ctx
        delta = state.delta
        request = Request(
            shared={"models": state.models, "directions": delta},
            settings={"train": ctx.train, "round": rnd, "purpose": "decide"},
        )
        replies = ctx.ask(GRADIENT_PRODUCTS, selected, request, rnd)
        selected = replies.clients
        loss, grad_sq, grad_dot = replies["losses"], replies["sq"], replies["dot"]
        if p.loss_reduction == "sum":  # eq. 1: L and its gradient are sums over the batch
            b = torch.as_tensor(np.minimum(ctx.train_sizes[selected], ctx.train.batch_size))
            loss = loss * b.unsqueeze(1).to(loss.dtype)
            grad_sq = grad_sq * b.unsqueeze(1).double().square()
            grad_dot = grad_dot * b.unsqueeze(1).double()
        delta_sq = delta.double().square().sum(dim=1)
        scores = jgl_scores(loss, grad_sq, grad_dot, delta_sq, p.lam, p.similarity, p.gradient_sign)
        rng = self.tie_rng(rnd)
        choice = argmax_random_ties(scores, rng)
        if p.empty_cluster_fix:
            choice = fix_empty_clusters(choice, p.n_clusters, rng)
        return Choice(selected, choice)
