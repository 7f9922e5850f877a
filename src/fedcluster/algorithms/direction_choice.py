"""The cluster choice on the device by released cluster directions, for DCFL and FedGroup
(``choice_on_device``, beyond both papers; docs/privacy.md, "The cluster choice on the
client").

Both papers place a *newcomer* by comparing its update with the clusters' directions:
DCFL eq. 6 (Augello, Falzone, Lo Re, "DCFL: dynamic clustered federated learning under
differential privacy settings", PerCom Workshops 2023, Sec. II-C: train from W_G, the
average of the cluster models, and join the cluster whose vector W_G -> W_Ck is nearest
by eq. 2) and FedGroup eq. 9 (Duan et al., "FedGroup: accurate federated learning via
decomposed similarity-based clustering", Sec. III-D: the group whose direction has the
largest cosine with the client's update). With ``choice_on_device`` every selected
client runs that rule every round, on its device, in one message
(:data:`DIRECTION_CHOOSE_AND_TRAIN`):

1. train from W_G = the mean of the K released cluster models, giving its own noiseless
   update u (a probe that never leaves the device);
2. compare u with each released direction δ̃_k by the algorithm's rule and choose k;
3. train from the released model W_Ck and upload only that model and k.

The server averages each cluster with ``ctx.aggregate`` (central DP's noisy mean when on)
and never compares individual updates, so the run is covered by central DP
(:mod:`fedcluster.privacy.central`) as IFCA's choice is: each clipped update joins one
cluster sum. The choice leaves the device in the clear, as IFCA's does.

**The directions: each cluster's last released step.** δ̃_k = W_Ck^t − W_Ck^{t−1}, the
step of the last round in which cluster k was aggregated, not W_Ck − W_G. All members of
cluster k trained from W_Ck^{t−1}, so under central DP the step is Σ clip(u_i, C_t)/n_k
plus the noise of *one* aggregate, N(0, (z_Δ C_t / n_k)²) per coordinate; W_Ck − W_G
holds the sum of every past round's noise of cluster k and of the others (through W_G),
√t times one round's. The rule compares the client's update with δ̃_k, so the noise's
squared norm enters every comparison; its mean is subtracted below, but its spread
(s_k²·√(2d) for s_k per coordinate) cannot be, and it is the same for every client of a
round: accumulated over t rounds it would be a random preference of all clients for
some clusters. Before a cluster's first aggregation its direction is its offset from
W_G, W_Ck − W_G of the initial models, which are public and noiseless.

**The noise term.** A released step carries noise of variance s_k² = (z_Δ C_t / n_k)² per
coordinate (z_Δ: :attr:`CentralDP.update_noise`; C_t: the clip in force when the step was
released; n_k: the cluster's members in that aggregate; all public), so with d compared
coordinates E‖u − δ̃_k‖² = ‖u − δ_k‖² + d s_k² and E‖δ̃_k‖² = ‖δ_k‖² + d s_k². Without the
correction a small cluster (large s_k) would look far from everyone and the largest
cluster would attract every client. DCFL's eq. 2 from the common origin W_G depends on
‖u − δ̃_k‖ (the end points' distance |BD|) and ‖δ̃_k‖ (in the divergence ω = |BD| /
(‖u‖ + ‖δ̃_k‖)); both squared norms are taken less d s_k²
(:func:`~fedcluster.clustering.distances.dcfl_distance_to_directions`), ‖u‖ has no
noise. FedGroup's cosine ⟨u, δ̃_k⟩ / (‖u‖ ‖δ̃_k‖) has an unbiased numerator and the same
term in the norm (:func:`~fedcluster.clustering.distances.cosine_to_directions`). The
server sends s_k (``direction_noise``) in the request's settings; without central DP it
is 0 (local DP's noise on the uploads is not modelled).

**Initial clusters.** K independent random models, or with ``init: private`` the
private start's (:func:`initial_cluster_models`, the one place they come from; a DP
clustering of the clients' first updates whose releases central DP accounts,
:mod:`fedcluster.privacy.private_start`): the rules that find clusters from individual
updates (DCFL's affinity propagation and Dunn-index re-clustering, FedGroup's SVD +
K-Means cold start) need the server to compare clients' updates, which the device
choice exists to avoid.
Ties (equal scores) go to the lowest cluster index.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar, cast

import numpy as np
import torch
from pydantic import Field, model_validator

from fedcluster.algorithms.aggregation import cluster_average
from fedcluster.algorithms.base import AlgorithmParams, Context, Exchange, weighted_loss
from fedcluster.algorithms.cluster_models import private_initial_models
from fedcluster.clustering.distances import (
    DcflVariant,
    cosine_to_directions,
    dcfl_distance_to_directions,
)
from fedcluster.engine.client_computations import TRAIN, chosen_start_training
from fedcluster.privacy.private_start import PrivateStart, private_start_field
from fedcluster.protocol.batches import LocalTraining
from fedcluster.protocol.client_side import ClientBatch
from fedcluster.protocol.computation import Payload, Request, register_computation

DeviceState = TypeVar("DeviceState")
"""DCFL's or FedGroup's state (:meth:`DirectionRound.applied`)."""

PROBE_PURPOSE = "probe"
"""The batch stream of the probe training from W_G (the chosen model trains on ``train``'s)."""


def direction_scores(
    updates: torch.Tensor, directions: torch.Tensor, noise: torch.Tensor, rule: str
) -> torch.Tensor:
    """Each update's score for each direction [n, K], lower is nearer: DCFL eq. 2 of the
    named variant (``rule`` ``dcfl-<variant>``) or FedGroup's eq. 9 (``cosine``: the
    negative cosine), the noise of ``noise`` [K] (per coordinate) subtracted."""
    noise_sq = directions.shape[1] * noise.double().square()
    if rule == "cosine":
        return -cosine_to_directions(updates, directions, noise_sq)
    variant = cast(DcflVariant, rule.removeprefix("dcfl-"))  # checked by the distance
    return dcfl_distance_to_directions(updates, directions, noise_sq, variant=variant)


def _choose_by_direction_and_train(batch: ClientBatch, request: Request) -> Payload:
    """Probe training from W_G, the rule against the released directions, then training
    from the chosen cluster's model (module docstring)."""
    s = request.settings
    models, directions = request.shared["models"], request.shared["directions"]
    w_g = models.mean(dim=0)
    probe = TRAIN.compute(
        batch,
        Request(
            shared={"start": w_g},
            settings={"train": s["train"], "round": s["round"], "purpose": PROBE_PURPOSE},
        ),
    )
    width = batch.layout.param_dim if s["compare"] == "parameters" else batch.dim
    noise = torch.as_tensor(s["direction_noise"], dtype=torch.float64)
    scores = direction_scores(
        (probe["row"] - w_g)[:, :width], directions[:, :width], noise, s["rule"]
    )
    choice = scores.argmin(dim=1)
    training = Request(
        own={"start": models[choice]}, settings={"train": s["train"], "round": s["round"]}
    )
    trained = TRAIN.compute(batch, training)
    return {**trained, "cluster": choice.to(torch.int32)}


DIRECTION_CHOOSE_AND_TRAIN = register_computation(
    chosen_start_training("direction-choose-and-train", _choose_by_direction_and_train)
)
"""DCFL's eq. 6 or FedGroup's eq. 9 on the device (``choice_on_device``): receive the K
models and their released directions (and the rule, the directions' noise per
coordinate and what is compared in the settings), train a probe from their mean, choose,
train the chosen model and upload it with the cluster id (counted: the model and one
int32). The probe stays on the device."""


class DeviceStartParams(AlgorithmParams):
    """Where a device choice's K initial clusters come from (DCFL's and FedGroup's params)."""

    init: Literal["random", "private"] = Field(
        "random",
        description="with choice_on_device: K independent random models, or the private "
        "start (a DP clustering of the clients' first updates, docs/privacy.md)",
    )
    private_start: PrivateStart = private_start_field()

    @model_validator(mode="after")
    def _start_needs_device(self) -> DeviceStartParams:
        if self.init == "private" and not getattr(self, "choice_on_device", False):
            raise ValueError(
                "init: private needs choice_on_device: the private start gives the K "
                "initial clusters the devices choose from"
            )
        return self


def initial_cluster_models(
    ctx: Context, k: int, who: str, params: DeviceStartParams
) -> torch.Tensor:
    """The K initial cluster models [K, d] of a device choice (module docstring), the one
    place they come from: independent random models, or the private start's
    (:func:`~fedcluster.algorithms.cluster_models.private_initial_models`)."""
    if params.init == "private":
        return private_initial_models(ctx, k, params.private_start, who)
    return ctx.fresh_rows(k, f"{who}/device-init")


def initial_directions(models: torch.Tensor) -> torch.Tensor:
    """Each cluster's direction before its first aggregation: W_Ck − W_G [K, d]."""
    return models - models.mean(dim=0)


@dataclass(frozen=True)
class DirectionRound:
    """One round of a device choice: the accepted uploads, their clusters, and the
    cluster models, directions and directions' noise after aggregation."""

    exchange: Exchange
    choice: np.ndarray
    models: torch.Tensor
    directions: torch.Tensor
    noise: torch.Tensor
    loss: float
    """The round's training loss: sample-weighted over the accepted uploads, or the
    contributors' mean under secure aggregation (NaN without any)."""

    def applied(self, state: DeviceState) -> DeviceState:
        """``state`` (a dataclass with ``models``, ``assign``, ``directions`` and
        ``direction_noise``) after this round: the new models, directions and noise, and
        the accepted clients' clusters."""
        fields: Any = state
        assign = fields.assign.copy()
        assign[self.exchange.clients] = self.choice
        new = replace(
            fields,
            models=self.models,
            assign=assign,
            directions=self.directions,
            direction_noise=self.noise,
        )
        return cast(DeviceState, new)


def direction_round(
    ctx: Context,
    models: torch.Tensor,
    directions: torch.Tensor,
    noise: torch.Tensor,
    rule: str,
    selected: np.ndarray,
    rnd: int,
    train: LocalTraining,
    by_samples: bool = False,
) -> DirectionRound:
    """``selected`` choose by ``rule`` and train (:data:`DIRECTION_CHOOSE_AND_TRAIN`, local
    training ``train``); each cluster with accepted members is aggregated by
    ``ctx.aggregate`` from its model (``by_samples``: weighted by sample count, which is
    then uploaded too) and releases its step as its new direction. The accepted uploads
    enter central DP's ledger, as every training upload does."""
    request = Request(
        shared={"models": models, "directions": directions},
        settings={
            "train": train,
            "round": rnd,
            "rule": rule,
            "direction_noise": [float(s) for s in noise],
            "compare": ctx.compare,
        },
    )
    if ctx.secure:
        return secure_direction_round(ctx, models, directions, noise, selected, rnd, request)
    replies = ctx.ask(
        DIRECTION_CHOOSE_AND_TRAIN, selected, request, rnd, metadata_ints=int(by_samples)
    )
    choice = replies["cluster"].numpy().astype(np.int64)
    starts = models[torch.as_tensor(choice)]
    ctx.observe_uploads(replies.clients, starts, replies["row"])
    ex = Exchange(replies.keep, replies.clients, replies["row"], replies["loss"])
    if not len(ex.clients):
        return DirectionRound(ex, choice, models, directions, noise, float("nan"))
    weights = ctx.train_sizes[ex.clients] if by_samples else None
    new = cluster_average(ex.rows, choice, models, weights, ctx.aggregate, start=starts)
    counts = np.bincount(choice, minlength=len(models))
    loss = weighted_loss(ex.loss, ctx.train_sizes[ex.clients])
    return _released_round(ctx, ex, choice, models, new, (directions, noise), counts, loss)


def secure_direction_round(
    ctx: Context,
    models: torch.Tensor,
    directions: torch.Tensor,
    noise: torch.Tensor,
    selected: np.ndarray,
    rnd: int,
    request: Request,
) -> DirectionRound:
    """:func:`direction_round` under secure aggregation (:mod:`fedcluster.protocol.secure_sum`):
    the server receives each cluster's clipped sum and size only, releases the trusted
    server's models from them and their steps as directions; who chose which cluster
    stays unknown to it (no accepted exchange: ``assign`` unchanged)."""
    new, total = ctx.secure_total(DIRECTION_CHOOSE_AND_TRAIN, selected, request, rnd)
    none = np.zeros(0, dtype=np.int64)
    ex = Exchange(np.zeros(len(selected), dtype=bool), none, new[:0], torch.zeros(0))
    steps = (directions, noise)
    return _released_round(ctx, ex, none, models, new, steps, total.counts, total.mean_loss)


def _released_round(
    ctx: Context,
    ex: Exchange,
    choice: np.ndarray,
    models: torch.Tensor,
    new: torch.Tensor,
    steps: tuple[torch.Tensor, torch.Tensor],
    counts: np.ndarray,
    loss: float,
) -> DirectionRound:
    """The round's outcome: the clusters with members (``counts``) release their step as
    their new direction, with that step's noise (``steps``: the directions and their noise
    before the round)."""
    moved = torch.as_tensor(counts > 0)
    new_directions, new_noise = steps[0].clone(), steps[1].clone()
    new_directions[moved] = (new - models)[moved]
    new_noise[moved] = step_noise(ctx, counts)[moved]
    return DirectionRound(ex, choice, new, new_directions, new_noise, loss)


def step_noise(ctx: Context, counts: np.ndarray) -> torch.Tensor:
    """Per-coordinate standard deviation [K] of the noise in each cluster's step released
    this round: z_Δ·C_t/n_k under central DP (C_t the clip now in force, which the round's
    aggregates used), 0 without it or for a cluster without members."""
    if ctx.central is None:
        return torch.zeros(len(counts), dtype=torch.float64)
    scale = ctx.central.update_noise * ctx.central.clip
    n = torch.as_tensor(counts, dtype=torch.float64)
    return torch.where(n > 0, scale / n.clamp_min(1.0), 0.0)
