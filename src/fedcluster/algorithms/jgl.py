"""JGL: joint gradient and loss based clustered FL (the JGL paper).

Alg. 1 of the paper. Each round the server broadcasts the K cluster models and
their last updates Δw_k = w_k^t − w_k^{t−1} (eq. 2). Each device, on one
mini-batch of its own data, computes for every k the loss L_{i,k} (eq. 1, a
*sum* over the batch) and its gradient ∇L_{i,k}, the similarity S_{i,k}
(eq. 3) and chooses s_i = argmax_k λ·S_{i,k} + (1 − λ)·(−L_{i,k}) (eq. 4); the device
trains the chosen model and uploads (model, s_i); the server averages per
cluster (eq. 7). Sec. II-C's empty-cluster fix gives every empty cluster one
randomly chosen device.

Two protocols. By default the device returns its products
(:data:`GRADIENT_PRODUCTS`) and the server scores, chooses, applies the fix
and sends each device its model to train (two messages). With
``choice_on_device`` the device does all of Alg. 1's lines 3-12 in one
message (:data:`CHOOSE_AND_TRAIN`, which IFCA uses with its loss rule): it
breaks exact ties from its own stream of a seed the request carries, and the
fix becomes an allocation in the next round's request
(:func:`pin_empty_clusters`), since the server sees the choices only with the
trained models (docs/flower.md, "The choice on the device").

Sign of the similarity. Δw_k points along the *negative* gradient of the
cluster's devices, so a device whose data agrees with cluster k has ∇L_{i,k}
pointing opposite to Δw_k. Eq. 3 as printed, cos(∇L, Δw), would push devices
away from their cluster; the default ``gradient_sign="descent"`` scores
cos(−∇L_{i,k}, Δw_k) and ``"literal"`` reproduces the printed form. Before any
cluster has been updated (Δw_k = 0) the similarity is 0 and the loss decides.
The euclidean alternative of Sec. II-B is S = −‖g − Δw_k‖ with the same sign
convention for g.

Readings of eq. 1/3/4 (ablation in docs/reproduction.md; each round's diagnostics
log ``differs_from_loss_choice``, the clients whose choice is not IFCA's).
With the printed sum over the batch, the cosine similarity and λ = 0.2 the
similarity almost never changes a choice (6 of 640 choices on the scaled
MNIST table; 0 on the main job): JGL is IFCA. With the cosine similarity no
λ or reduction separates the merged groups either. The one reading that did
(one seed, 8 rounds: purity 0.94 at round 8 where IFCA stays at 0.75) is
``similarity: "euclidean"`` with λ = 0.5 and the summed loss: the summed
gradient's distance to Δw_k then weighs as much as the loss. λ = 0.8 with
the euclidean similarity lets the gradient norm decide and clusters worse.
No reading reproduces the paper's "99% fewer iterations to 0.9 purity";
cluster repair (:mod:`fedcluster.algorithms.repair`) is what separates merged
groups reliably.

``shared_layers`` shares layers across the K models as IFCA's weight sharing
does (:mod:`fedcluster.algorithms.cluster_models`); beyond JGL's paper.

Both similarities need only ‖∇L_{i,k}‖² and ⟨∇L_{i,k}, Δw_k⟩, which the
simulator computes without forming the K gradients of d floats per device
(:meth:`~fedcluster.engine.simulator.Simulator.losses_and_gradient_products`).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field

from fedcluster.algorithms.base import register
from fedcluster.algorithms.cluster_models import (
    Choice,
    ClusterModelAlgorithm,
    ClusterModelParams,
    ClusterModelState,
    argmax_random_ties,
)
from fedcluster.engine.client_computations import (
    DECISION_EXEMPTION,
    LOSSES,
    TRAIN,
    chosen_start_training,
    n_models,
)
from fedcluster.protocol.channel import Replies
from fedcluster.protocol.client_side import ClientBatch
from fedcluster.protocol.computation import (
    ClientComputation,
    Payload,
    ReplyField,
    Request,
    Settings,
    register_computation,
)
from fedcluster.rng import numpy_rng


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


def eq4_scores(
    products: Payload,
    delta: torch.Tensor,
    train_sizes: np.ndarray,
    batch_size: int,
    params: dict,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The losses L_{i,k} and eq. 4's scores [n, K] from the replies of
    :data:`GRADIENT_PRODUCTS` (``products``: mean loss, ‖∇‖², ⟨∇, Δw_k⟩ on one
    mini-batch) and the last updates ``delta`` [K, d]; ``params`` holds λ and
    the readings (:class:`JGLParams`' ``lam``, ``similarity``,
    ``gradient_sign``, ``loss_reduction``). Where the client is, on the device
    (``choice_on_device``), or on the server."""
    loss, grad_sq, grad_dot = products["losses"], products["sq"], products["dot"]
    if params["loss_reduction"] == "sum":  # eq. 1: L and its gradient are sums over the batch
        b = torch.as_tensor(np.minimum(train_sizes, batch_size))
        loss = loss * b.unsqueeze(1).to(loss.dtype)
        grad_sq = grad_sq * b.unsqueeze(1).double().square()
        grad_dot = grad_dot * b.unsqueeze(1).double()
    delta_sq = delta.double().square().sum(dim=1)
    scores = jgl_scores(
        loss,
        grad_sq,
        grad_dot,
        delta_sq,
        params["lam"],
        params["similarity"],
        params["gradient_sign"],
    )
    return loss, scores


def loss_choice_differences(choice: np.ndarray, loss: torch.Tensor) -> int:
    """Clients whose choice differs from the lowest-loss cluster (eq. 4 with λ = 0)."""
    return int((choice != loss.argmin(dim=1).numpy()).sum())


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


def _gradient_products(batch: ClientBatch, request: Request) -> Payload:
    s = request.settings
    loss, sq, dot = batch.losses_and_gradient_products(
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
            "losses": ReplyField(n_models, counted=False),
            "sq": ReplyField(n_models, counted=False, dtype=torch.float64),
            "dot": ReplyField(n_models, counted=False, dtype=torch.float64),
        },
        batched_run=_gradient_products,
        exempt_because=DECISION_EXEMPTION,
    )
)
"""JGL's device-side quantities (eq. 1, 3): for each received model k, the loss L_{i,k}
on one mini-batch, ‖∇L_{i,k}‖² and ⟨∇L_{i,k}, Δw_k⟩ with the received last update Δw_k."""


def pin_empty_clusters(last: np.ndarray, n_clusters: int, rng: np.random.Generator) -> np.ndarray:
    """Sec. II-C when the device chooses: the clusters [n] (−1: free) the server
    allocates the asked clients to in its request.

    ``last`` [n] is each asked client's cluster of its last accepted upload (−1:
    none). A cluster none of them was last in gets one of them, drawn as
    :func:`fix_empty_clusters` draws a device from a cluster that can spare one;
    that device trains the cluster's model instead of choosing, so the cluster's
    Δw_k moves again (the paper's reason for the fix).
    """
    pins = np.full(len(last), -1, dtype=np.int64)
    known = np.flatnonzero(last >= 0)
    if len(known):
        fixed = fix_empty_clusters(last[known], n_clusters, rng)
        moved = fixed != last[known]
        pins[known[moved]] = fixed[moved]
    return pins


def _choose_and_train(batch: ClientBatch, request: Request) -> Payload:
    """Each client's eq. 4 (``rule: jgl``) or IFCA (``rule: loss``) choice among the K
    received models, then local training of the chosen (or allocated) one."""
    s = request.settings
    models = request.shared["models"]
    if s["rule"] == "jgl":
        products = GRADIENT_PRODUCTS.compute(batch, request)
        loss, scores = eq4_scores(
            products, request.shared["directions"], batch.train_sizes, s["train"].batch_size, s
        )
    else:
        loss = LOSSES.compute(batch, request)["losses"]
        scores = -loss
    ids = batch.ids
    choice = np.array(
        [
            argmax_random_ties(scores[i : i + 1], numpy_rng(s["tie_seed"], "device", int(c)))[0]
            for i, c in enumerate(ids)
        ],
        dtype=np.int64,
    ).reshape(-1)
    differs = choice != loss.argmin(dim=1).numpy()
    pins = np.array([request.settings_of(i).get("pin", -1) for i in range(len(batch))])
    choice = np.where(pins >= 0, pins, choice).astype(np.int64)
    start = models[torch.as_tensor(choice)]
    training = Request(own={"start": start}, settings={"train": s["train"], "round": s["round"]})
    assert TRAIN.batched_run is not None
    trained = TRAIN.compute(batch, training)
    return {
        **trained,
        "cluster": torch.as_tensor(choice, dtype=torch.int32),
        "differs": torch.as_tensor(differs, dtype=torch.int64),
    }


CHOOSE_AND_TRAIN = register_computation(
    chosen_start_training(
        "choose-and-train",
        _choose_and_train,
        {"differs": ReplyField((), counted=False, dtype=torch.int64)},
    )
)
"""JGL Alg. 1 on the device (``choice_on_device``): receive the K models (JGL: and
their updates Δw_k, and λ with the readings of eq. 1/3/4 in the settings), choose
(eq. 3-4; IFCA: the lowest loss), train the chosen model, upload it with the
cluster id (counted: the model and one int32). The decision's losses stay on the
device; ``differs`` (eq. 4's choice is not the loss argmin) is instrumentation."""


@register
class JGL(ClusterModelAlgorithm[JGLParams]):
    """JGL (Alg. 1): device-side cluster choice from gradient similarity and loss.

    Diagnostics: ``differs_from_loss_choice``, the clients whose eq. 4 choice is not
    IFCA's (λ = 0), counted each round before Sec. II-C's empty-cluster fix from the
    same scores (the loss argmin of the same mini-batch); with repair, its
    diagnostics too.
    """

    name = "jgl"
    Params = JGLParams

    def choose(self, state: ClusterModelState, rnd: int, selected: np.ndarray) -> Choice:
        p = self.params
        ctx = self.ctx
        delta = ctx.parameter_part(state.delta)  # eq. 3 compares gradients: parameters only
        shared = {"models": state.models, "directions": delta}
        request = Request(
            shared=shared,
            settings={"train": ctx.train, "round": rnd, "purpose": "decide"},
            tied=self.tied(shared),
        )
        replies = ctx.ask(GRADIENT_PRODUCTS, selected, request, rnd)
        selected = replies.clients
        loss, scores = eq4_scores(
            replies.fields, delta, ctx.train_sizes[selected], ctx.train.batch_size, vars(p)
        )
        rng = self.tie_rng(rnd)
        choice = argmax_random_ties(scores, rng)
        differs = loss_choice_differences(choice, loss)
        if p.empty_cluster_fix:
            choice = fix_empty_clusters(choice, p.n_clusters, rng)
        return Choice(selected, choice, {"differs_from_loss_choice": float(differs)})

    def choose_and_train(
        self, state: ClusterModelState, rnd: int, selected: np.ndarray
    ) -> tuple[Replies, dict[str, float]]:
        """Alg. 1 in one message per node (:data:`CHOOSE_AND_TRAIN`); Sec. II-C's fix
        allocates a device to each cluster none of the asked devices was last in
        (:func:`pin_empty_clusters`), since the server sees this round's choices only
        with the trained models."""
        p = self.params
        pins = None
        if p.empty_cluster_fix:
            rng = numpy_rng(self.ctx.seed, f"{self.name}/pins", rnd)
            pins = pin_empty_clusters(state.assign[selected], p.n_clusters, rng)
        computation, rule, shared = self.device_choice(state)
        replies = self.ask_device_choice(computation, state, rnd, selected, rule, shared, pins)
        return replies, {"differs_from_loss_choice": float(replies["differs"].sum())}

    def device_choice(
        self, state: ClusterModelState
    ) -> tuple[ClientComputation, Settings, Payload]:
        """Eq. 4 on the device (:data:`CHOOSE_AND_TRAIN`) against the released models and
        their released steps Δw_k."""
        p = self.params
        rule = {
            "rule": "jgl",
            "lam": p.lam,
            "similarity": p.similarity,
            "gradient_sign": p.gradient_sign,
            "loss_reduction": p.loss_reduction,
        }
        return CHOOSE_AND_TRAIN, rule, {"directions": state.delta}
