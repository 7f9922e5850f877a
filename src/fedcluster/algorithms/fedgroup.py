"""FedGroup and FedGrouProx: Duan, Liu, Ji, Liu, Liang, Chen, Tan, "FedGroup:
accurate federated learning via decomposed similarity-based clustering", Alg. 2 and Alg. 3.

- Group cold start (Alg. 3), in round 1: α·m random clients (α =
  ``pretrain_scale``, m = ``n_groups``) receive w0, train from it and upload
  their updates ΔW (lines 2-5). EDC (default): the updates are decomposed by
  truncated SVD into m directions V (eq. 8) and K-Means++ clusters the
  embedding cos(ΔW, V) (lines 12-14; its euclidean distances are m·EDC).
  MADC: complete-linkage hierarchical clustering of the MADC matrix (eq. 7,
  lines 8-10). Each group model is the average of its members' models and
  its direction Δw_0^(g) = w_0^(g) − w0 (lines 15-17; line 16 prints "average
  of the updates", the reference code averages the models: the two agree up
  to the shift by w0, which line 17 subtracts).
- Client cold start (eq. 9): a client not yet in a group, the first time it
  is selected, trains from w0 and joins the group minimising
  (1 − cos(Δw_0^(g), Δw_pre))/2, i.e. with the largest cosine.
- Training (Alg. 2): selected clients train their group's model; each group
  with participants averages their models by sample count (FedAvg, Alg. 1
  line 8), or FedProx with ``mu`` > 0 (FedGrouProx, lines 13-14); empty
  groups keep their model (line 12). Inter-group aggregation (lines 16-18)
  with rate η_g > 0: line 18 adds η_g Σ_{l≠j} w_l/‖w_l‖ to group j; as printed
  this grows every model's norm each round, so, as the reference code does,
  the sum is normalised: w_j ← (w_j + η_g Σ_{l≠j} w_l/‖w_l‖) /
  (1 + η_g Σ_{l≠j} 1/‖w_l‖).
- Ablations (Table III): ``rcc`` (random cluster centres: m random clients
  pre-train and each is one group's centre, as in the reference code) and
  ``rac`` (cold clients join a uniformly random group, without pre-training;
  the pre-training clients keep their groups).

Pre-training is one epoch of plain SGD (``pretrain_epochs``; the paper: "the
pre-training procedure does not occupy a whole round, the client can continue
to train E−1 epochs"); its mini-batches depend on (seed, client) only, as a
client pre-trains once (again only after a rejected update or a failed group
cold start, below). Bytes: every pre-training costs w0 down and the update
up. Clients not yet in a group are evaluated with the auxiliary global model,
the average of the group models (the paper scores only clients already
assigned to a group).

Rejected updates (:meth:`~fedcluster.algorithms.base.Context.exchange`) are
left out of grouping and averaging. A pre-training client whose update is
rejected stays without a group and cold-starts (pre-training again) when next
selected; a cold client whose update is rejected sits its round out. If fewer
pre-training updates than groups (3 for MADC) are accepted, the group cold
start cannot group them: the round ends without training (loss NaN) and the
next round retries with a fresh draw of clients (``state.cold_start_retries``
keys the draw; the first draw is unchanged). A round without an accepted update
changes no model.

The choice on the device (``choice_on_device``, beyond the paper;
:mod:`fedcluster.algorithms.direction_choice`): every selected client runs the client
cold start (eq. 9) every round on its device -- trains a probe from the auxiliary global
model (the mean of the group models), joins the group whose released direction (its last
released step) has the largest cosine with the probe's update, its norm less the
direction's expected noise, trains that group's model and uploads it with the group id
-- and the server only averages each group, so FedGroup runs under central DP without
sketches. The m groups start as m random models; the group cold start (Alg. 3: SVD +
K-Means++ or MADC on pre-training updates) compares individual updates and does not run,
and settings that only it or the newcomers' pre-training use (``pretrain_scale``,
``pretrain_epochs``, ``measure``, ``rcc``, ``rac``), and the inter-group aggregation
(``eta_g``, which mixes the released steps), are refused with it.

Dynamic federations (:mod:`fedcluster.experiment.scenario`). The group cold start draws
its α·m clients among the clients reachable in its round (waiting for a round
with at least as many reachable clients as it needs); every client that joins
later is a cold client and is placed by the client cold start (eq. 9), the
paper's newcomer mechanism ("the new devices can join the training at any
time", Sec. III-D). A failed pre-training client is treated like a rejected
one. Drift: no reaction -- groups are static once assigned (the paper has no
migration; its successor FlexCFL adds one).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch
from pydantic import Field, model_validator

from fedcluster.algorithms.aggregation import cluster_average, eval_rows_with_average
from fedcluster.algorithms.base import (
    Algorithm,
    Exchange,
    RoundOutput,
    State,
    log,
    register,
    weighted_loss,
)
from fedcluster.algorithms.cluster_count import AUTO_HELP
from fedcluster.algorithms.cluster_models import loss_choice
from fedcluster.algorithms.direction_choice import (
    DeviceStartParams,
    direction_round,
    initial_cluster_models,
    initial_directions,
)
from fedcluster.clustering.distances import cosine_to, madc_matrix, svd_directions
from fedcluster.clustering.methods import hierarchical, kmeans_pp
from fedcluster.errors import ConfigError
from fedcluster.rng import numpy_rng

PRETRAIN_PURPOSE = "pretrain"  # batch purpose of pre-training (round key 0)


@dataclass
class FedGroupState(State):
    models: torch.Tensor
    """The m group models [m, d]."""
    directions: torch.Tensor
    """Each group's optimisation direction [m, d]: Alg. 3's w_0^(g) − w0, or with
    ``choice_on_device`` its last released step (its offset from the mean of the group
    models before its first aggregation)."""
    direction_noise: torch.Tensor
    """The per-coordinate noise std of each direction [m] (central DP; 0: noiseless)."""
    assign: np.ndarray
    """Each client's group (−1: cold)."""
    grouped: bool
    """Whether the group cold start has happened."""
    cold_start_retries: int


class FedGroupParams(DeviceStartParams):
    n_groups: int = Field(
        3, ge=1, description="number of groups m (paper: MNIST 3, others 5)" + AUTO_HELP
    )
    pretrain_scale: int = Field(
        20, ge=1, description="α: α·m random clients pre-train for the group cold start"
    )
    pretrain_epochs: int = Field(1, ge=1, description="local epochs of pre-training from w0")
    measure: Literal["edc", "madc"] = Field(
        "edc", description="EDC + K-Means++ (eq. 8) or MADC + complete linkage (eq. 7)"
    )
    mu: float = Field(0.0, ge=0.0, description="FedProx proximal coefficient μ (0 = FedGroup)")
    eta_g: float = Field(0.0, ge=0.0, description="inter-group aggregation rate η_g (0 = off)")
    rcc: bool = Field(False, description="ablation RCC: m random clients as group centres")
    rac: bool = Field(False, description="ablation RAC: cold clients join a random group")
    choice_on_device: bool = Field(
        False,
        description="every client runs eq. 9 on its device each round (probe from the mean of "
        "the group models, the released group step of largest cosine) and uploads its model "
        "with the group id; no group cold start",
    )

    @model_validator(mode="after")
    def _device_settings(self) -> FedGroupParams:
        if not self.choice_on_device:
            return self
        fields = type(self).model_fields
        unused = [
            name
            for name in ("pretrain_scale", "pretrain_epochs", "measure", "rcc", "rac", "eta_g")
            if getattr(self, name) != fields[name].default
        ]
        if unused:
            raise ValueError(
                f"{unused[0]} cannot be used with choice_on_device: the group cold start and "
                "the pre-training compare individual updates, and inter-group aggregation "
                "mixes the released steps the devices compare with"
            )
        return self


class FedGrouProxParams(FedGroupParams):
    mu: float = Field(
        1.0,
        gt=0.0,
        description="proximal μ; FedProx's recommendation for MNIST, FEMNIST and Synthetic",
    )


def group_labels(
    updates: torch.Tensor, n_groups: int, measure: str, random_state: int
) -> np.ndarray:
    """Alg. 3 lines 7-14: the groups of pre-training updates [n, d] by EDC or MADC."""
    if measure == "edc":
        embedding = cosine_to(updates, svd_directions(updates, n_groups))
        return kmeans_pp(embedding, n_groups, random_state=random_state)
    return hierarchical(madc_matrix(updates), n_clusters=n_groups, linkage="complete")


def inter_group_aggregation(models: torch.Tensor, eta_g: float) -> torch.Tensor:
    """Alg. 2 lines 16-18, normalised (module docstring): mix in the other groups' unit models."""
    coef = eta_g / models.norm(dim=1)
    weights = coef.expand(len(models), -1).clone()
    weights.fill_diagonal_(1.0)
    return (weights @ models) / weights.sum(dim=1, keepdim=True)


@register
class FedGroup(Algorithm[FedGroupParams, FedGroupState]):
    """FedGroup (Alg. 2 + 3): static groups from decomposed update similarities."""

    name = "fedgroup"
    Params = FedGroupParams
    cluster_count = "n_groups"
    StateType = FedGroupState

    def init_state(self) -> FedGroupState:
        m = self.params.n_groups
        ctx = self.ctx
        assign = np.full(ctx.n_clients, -1, dtype=np.int64)
        noise = torch.zeros(m, dtype=torch.float64)
        if self.params.choice_on_device:
            models = initial_cluster_models(ctx, m, self.name, self.params)
            return FedGroupState(models, initial_directions(models), noise, assign, True, 0)
        models = ctx.init_row.unsqueeze(0).repeat(m, 1)
        return FedGroupState(models, torch.zeros(m, ctx.dim), noise, assign, False, 0)

    def run_round(
        self, state: FedGroupState, rnd: int, selected: np.ndarray
    ) -> RoundOutput[FedGroupState]:
        ctx = self.ctx
        if self.params.choice_on_device:
            return self.device_round(state, rnd, selected)
        if not state.grouped:
            state = self.group_cold_start(state)
            if not state.grouped:  # too few pre-training updates accepted: retried next round
                return RoundOutput(state, float("nan"))
        cold = selected[state.assign[selected] < 0]
        if len(cold):
            assign = state.assign.copy()
            assign[cold] = self.client_cold_start(state, cold, rnd)
            state = replace(state, assign=assign)
            selected = selected[assign[selected] >= 0]  # rejected cold clients sit out
        groups = state.assign[selected]
        ex = ctx.exchange(  # model and sample count
            selected, state.models[groups], rnd, ctx.local(mu=self.params.mu), ints=1
        )
        if not len(ex.clients):
            return RoundOutput(state, float("nan"))
        sizes = ctx.train_sizes[ex.clients]
        models = cluster_average(ex.rows, groups[ex.keep], state.models, sizes, ctx.aggregate)
        if self.params.eta_g > 0.0:
            models = inter_group_aggregation(models, self.params.eta_g)
        return RoundOutput(replace(state, models=models), weighted_loss(ex.loss, sizes))

    def device_round(
        self, state: FedGroupState, rnd: int, selected: np.ndarray
    ) -> RoundOutput[FedGroupState]:
        """``choice_on_device``: eq. 9 on every selected device against the released steps,
        then each group's aggregate by sample count (module docstring)."""
        ctx = self.ctx
        done = direction_round(
            ctx, state.models, state.directions, state.direction_noise, "cosine", selected, rnd,
            ctx.local(mu=self.params.mu), by_samples=True,
        )  # fmt: skip
        return RoundOutput(done.applied(state), done.loss)

    def pretrain(self, clients: np.ndarray) -> Exchange:
        """Clients receive w0, train ``pretrain_epochs`` from it and upload.

        Returns the exchange with the accepted clients' updates [m, d] as ``rows``.
        """
        ctx = self.ctx
        cfg = ctx.local(epochs=self.params.pretrain_epochs, steps=None, mu=0.0)
        ex = ctx.exchange(clients, ctx.init_row, 0, cfg, purpose=PRETRAIN_PURPOSE)
        return replace(ex, rows=ex.rows - ctx.init_row)

    def group_cold_start(self, state: FedGroupState) -> FedGroupState:
        """Alg. 3 (or RCC): pre-train random clients, group them; the state with the groups'
        models, directions and members.

        The clients are drawn among those reachable this round. Needs at
        least one accepted update per group (and 3 for MADC); with fewer,
        nothing is grouped (the state is returned ungrouped) and the next call
        draws other clients.
        """
        p = self.params
        ctx = self.ctx
        size = p.n_groups if p.rcc else min(p.pretrain_scale * p.n_groups, ctx.n_clients)
        need = p.n_groups if p.rcc or p.measure == "edc" else max(p.n_groups, 3)
        if size < need:
            raise ConfigError(
                f"fedgroup.pretrain_scale: the group cold start needs {need} pre-training "
                f"clients, got {size}"
            )
        available = ctx.available_clients()
        if len(available) < need:
            log.warning(
                "fedgroup: %d clients reachable, the group cold start needs %d; waiting",
                len(available),
                need,
            )
            return state
        retry = state.cold_start_retries
        rng = numpy_rng(ctx.seed, "fedgroup/pretrain-clients", *([retry] if retry else []))
        clients = np.sort(rng.choice(available, min(size, len(available)), replace=False))
        ex = self.pretrain(clients)
        if len(ex.clients) < need:
            log.warning(
                "fedgroup: %d of %d pre-training updates accepted, %d needed; "
                "the group cold start is retried with other clients",
                len(ex.clients),
                size,
                need,
            )
            return replace(state, cold_start_retries=state.cold_start_retries + 1)
        if p.rcc:
            labels = np.arange(len(ex.clients))
        else:
            _, updates = ctx.clustering_view(ex.clients, ctx.init_row, ex.rows, self.name)
            labels = group_labels(updates, p.n_groups, p.measure, int(rng.integers(2**31)))
        w0 = ctx.init_row.unsqueeze(0)
        models = cluster_average(
            ex.rows + w0, labels, w0.repeat(p.n_groups, 1), aggregate=ctx.aggregate
        )
        assign = state.assign.copy()
        assign[ex.clients] = labels
        return replace(state, models=models, directions=models - w0, assign=assign, grouped=True)

    def client_cold_start(self, state: FedGroupState, clients: np.ndarray, rnd: int) -> np.ndarray:
        """Eq. 9 (or RAC): the group of each cold client (−1: update rejected)."""
        if self.params.rac:
            return numpy_rng(self.ctx.seed, "fedgroup/rac", rnd).integers(
                self.params.n_groups, size=len(clients)
            )
        ex = self.pretrain(clients)
        groups = np.full(len(clients), -1, dtype=np.int64)
        if len(ex.clients):
            _, updates = self.ctx.clustering_view(ex.clients, self.ctx.init_row, ex.rows, self.name)
            _, directions = self.ctx.public_view(
                torch.zeros_like(state.directions), state.directions
            )
            groups[ex.keep] = cosine_to(updates, directions).argmax(dim=1).numpy()
        return groups

    def eval_rows(self, state: FedGroupState) -> tuple[torch.Tensor, np.ndarray]:
        if self.ctx.secure:  # who chose which cluster stays on the devices
            return state.models, loss_choice(self.ctx, state.models, state.assign)
        return eval_rows_with_average(state.models, state.assign)

    def clusters(self, state: FedGroupState) -> np.ndarray:
        return state.assign.copy()


@register
class FedGrouProx(FedGroup):
    """FedGrouProx: FedGroup with FedProx's proximal term (Alg. 2 line 14)."""

    name = "fedgrouprox"
    Params = FedGrouProxParams
