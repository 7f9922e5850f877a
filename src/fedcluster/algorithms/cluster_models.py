"""Shared machinery of methods that keep K cluster models and let clients choose.

Used by IFCA (Ghosh et al., "An efficient framework for clustered federated
learning", NeurIPS 2020, Alg. 1) and JGL (joint gradient and loss based
clustered FL, Alg. 1): the server holds K models [K, d] and each model's last update
Δw_k = w_k^t − w_k^{t−1} (JGL eq. 2); selected clients choose a cluster, train
its model and upload (model, cluster id); the server averages per cluster
(JGL eq. 7, IFCA's model averaging).

Rejected uploads (:meth:`~fedcluster.algorithms.base.Context.exchange`) are
left out: those clients keep their previous cluster id, a cluster none of whose
choosers was accepted keeps its model (and gets Δw_k = 0, as an unchosen
cluster does), and a round without an accepted upload changes nothing.

Dynamic federations (:mod:`fedcluster.experiment.scenario`): every selected client
chooses its cluster every round, so a newcomer needs no special rule and a
drifting client re-chooses by itself; the good initializer looks at the
clients present at the start.

Initial models are independent random initialisations, all equal, the
private start (:func:`private_initial_models`: every present client trains
once from the initial model and a DP clustering of the updates gives each
group's model, :mod:`fedcluster.privacy.private_start`), or IFCA's
"good initializer": the reference code re-draws random initial models until
every cluster is chosen (by loss) by at least ``min_cluster_share`` of the
clients. That re-drawing uses knowledge a real server lacks, so its traffic is
not counted; it is offered to reproduce the papers' baselines.

Weight sharing (``shared_layers``; IFCA, Ghosh et al. 2020, Sec. 5 and its
CIFAR experiments: all layers but the last shared across clusters). The K
models hold one copy of the named parameters (and float buffers): tied from
the initial models on (the first model's), and after each round's averaging
they are the average over every accepted client of every cluster, with the
weights of the per-cluster average; each cluster keeps its own other layers,
averaged within the cluster. A client chooses by its loss under each full
model (shared + own layers) and uploads its whole trained model. The broadcast
of the K models (JGL: and their Δw_k, whose shared columns are equal too)
sends the shared columns once (:attr:`~fedcluster.protocol.computation.Request.tied`):
(K − 1)·|shared|·4 bytes fewer per asked client and query. An unchosen
cluster keeps its own layers, and its shared layers move with everyone's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, TypeVar

import numpy as np
import torch
from pydantic import Field, field_validator, model_validator

from fedcluster.algorithms.aggregation import cluster_average
from fedcluster.algorithms.base import (
    Algorithm,
    AlgorithmParams,
    Context,
    Exchange,
    RoundOutput,
    State,
    log,
    weighted_loss,
)
from fedcluster.algorithms.cluster_count import AUTO_HELP
from fedcluster.algorithms.repair import ClusterRepair, apply_repair, repair_diagnostics
from fedcluster.algorithms.secure_start import DeviceStatistics
from fedcluster.engine.client_computations import LOSSES, TRAIN
from fedcluster.engine.flat import ParamLayout
from fedcluster.errors import ConfigError
from fedcluster.privacy.central import projection
from fedcluster.privacy.private_start import (
    PrivateStart,
    StartStatistics,
    UpdateStatistics,
    private_start,
    private_start_field,
)
from fedcluster.protocol.channel import Replies
from fedcluster.protocol.computation import ClientComputation, Payload, Request, Settings
from fedcluster.rng import derive_seed, numpy_rng


class ClusterModelParams(AlgorithmParams):
    n_clusters: int = Field(4, ge=1, description="number of cluster models K" + AUTO_HELP)
    init: Literal["random", "same", "private"] = Field(
        "random",
        description="independent random initial models, K copies of one, or the private "
        "start: w0 plus each group's mean first update, groups found by DP clustering",
    )
    private_start: PrivateStart = private_start_field()
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
    repair: ClusterRepair | None = Field(
        None, description="split incongruent clusters into starved ones (repair.py; None: off)"
    )
    choice_on_device: bool = Field(
        False,
        description="the device chooses its cluster and trains in one message "
        "(JGL Alg. 1); off: a decision query, then the training",
    )
    shared_layers: str | list[str] | None = Field(
        None,
        description="parameters the K models share, averaged over all clients (IFCA Sec. 5): "
        "'all_but_last' or a list of parameter names (None: off)",
    )

    @field_validator("shared_layers")
    @classmethod
    def _known_form(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, str) and value != ALL_BUT_LAST:
            raise ValueError(f"{value!r} is neither {ALL_BUT_LAST!r} nor a list of parameter names")
        if isinstance(value, list) and not value:
            raise ValueError("an empty list shares nothing; leave shared_layers out")
        return value

    @model_validator(mode="after")
    def _redraws_random_models(self) -> ClusterModelParams:
        if self.min_cluster_share > 0.0 and self.init != "random":
            raise ValueError(
                f"min_cluster_share re-draws random initial models; with init: {self.init} "
                "there is nothing to re-draw (leave one of them out)"
            )
        return self


ALL_BUT_LAST = "all_but_last"


def shared_columns(
    spec: str | list[str] | None, layout: ParamLayout, who: str
) -> torch.Tensor | None:
    """The row positions of the layers the K cluster models share (``shared_layers``).

    ``all_but_last``: every parameter and float buffer outside the last module
    holding parameters (IFCA's CIFAR setting); a list: those names
    (``ParamLayout.slots``/``buffer_slots``). A
    :class:`~fedcluster.errors.ConfigError` (prefixed ``who``) for an unknown
    name, or a choice that shares nothing or every parameter.
    """
    if spec is None:
        return None
    field = f"{who}.shared_layers"
    slots = layout.slots + layout.buffer_slots
    if spec == ALL_BUT_LAST:
        last = layout.last_module()
        names = [s.name for s in slots if s.name.rpartition(".")[0] != last]
        if not names:
            raise ConfigError(f"{field}: {spec!r} shares nothing: the model has only one layer")
    else:
        known = [s.name for s in slots]
        unknown = [n for n in spec if n not in known]
        if unknown:
            raise ConfigError(
                f"{field}: unknown parameter {unknown[0]!r}; the model's are {', '.join(known)}"
            )
        names = list(spec)
    if {s.name for s in layout.slots} <= set(names):
        raise ConfigError(
            f"{field}: {spec!r} shares every parameter, which makes the K models one; "
            "keep at least the last layer per cluster"
        )
    return layout.columns(names)


def private_initial_models(ctx: Context, k: int, params: PrivateStart, who: str) -> torch.Tensor:
    """K initial models [K, d] from the private start (:mod:`fedcluster.privacy.private_start`):
    the present clients train once from ``ctx.init_row`` (a counted training exchange before
    round 1), and model k is w0 plus group k's released mean clipped update. Under central
    DP the clip is its C_0 and the noise its start multiplier, and the start's releases enter
    every participant's ledger; under secure aggregation the server receives only the sums
    the start releases (:mod:`~fedcluster.algorithms.secure_start`)."""
    w0 = ctx.init_row
    request = Request(
        shared={"start": w0}, settings={"train": ctx.train, "round": 0, "purpose": "private-start"}
    )
    central = ctx.central
    clip, noise = (central.clip, central.start_noise) if central else (params.clip, 0.0)
    present = np.flatnonzero(ctx.present)
    stats: StartStatistics
    if ctx.secure:  # the devices contribute to each sum (secure_start)
        stats = DeviceStatistics(ctx, present, request, params.sketch_dim, clip)
        found = private_start(stats, k, params, clip, noise, ctx.seed)
        participants = stats.counted
    else:
        replies = ctx.ask(TRAIN, present, request, 0)
        participants = replies.clients
        if len(participants):
            matrix = projection(ctx.seed, ctx.dim, params.sketch_dim)
            stats = UpdateStatistics(replies["row"] - w0, matrix, clip)
            found = private_start(stats, k, params, clip, noise, ctx.seed)
    if not len(participants):
        log.warning("%s: no client answered the private start; K copies of w0", who)
        return w0.unsqueeze(0).repeat(k, 1)
    if central is not None:
        central.record_start(participants)
    log.info("%s: private start, clients per group %s", who, found.sizes.tolist())
    return w0 + found.updates


def loss_query(
    ctx: Context,
    models: torch.Tensor,
    clients: np.ndarray,
    rnd: int,
    purpose: str,
    batches: str = "one",
    measurement: bool = False,
    tied: dict[str, torch.Tensor] | None = None,
) -> Replies:
    """Each client's loss of the K ``models`` [n, K] on one mini-batch (``batches: all``:
    all) of its training data (:data:`~fedcluster.engine.client_computations.LOSSES`;
    ``tied``: shared columns sent once)."""
    request = Request(
        shared={"models": models},
        settings={"train": ctx.train, "round": rnd, "purpose": purpose, "batches": batches},
        tied=tied or {},
    )
    return ctx.ask(LOSSES, clients, request, rnd, measurement=measurement)


def loss_choice(
    ctx: Context,
    models: torch.Tensor,
    assign: np.ndarray,
    tied: dict[str, torch.Tensor] | None = None,
) -> np.ndarray:
    """``assign`` [n_clients] with every present client that has no cluster (−1) given the
    model of lowest loss on one mini-batch of its training data, as IFCA evaluates a
    never-selected client (a measurement; clients not present keep −1: nobody evaluates
    them). Under secure aggregation no client has one the server knows."""
    out = assign.copy()
    unknown = np.flatnonzero((out < 0) & ctx.present)
    if len(unknown):
        losses = loss_query(ctx, models, unknown, 0, "eval-choice", measurement=True, tied=tied)
        out[losses.clients] = losses["losses"].argmin(dim=1).numpy()
    return out


@dataclass(frozen=True)
class Choice:
    """The clients that chose (those that answered the decision query) and their clusters."""

    clients: np.ndarray
    clusters: np.ndarray
    diagnostics: dict[str, float] = field(default_factory=dict)
    """What the choice reports for ``diagnostics.csv`` (e.g. JGL's choices that are not
    the loss argmin)."""


def argmax_random_ties(score: torch.Tensor, rng: np.random.Generator) -> np.ndarray:
    """Row-wise argmax of ``score`` [n, K], breaking exact ties uniformly at random."""
    s = score.double().numpy()
    best = s.max(axis=1, keepdims=True)
    tie = rng.random(s.shape) * (s == best)
    return tie.argmax(axis=1)


@dataclass
class ClusterModelState(State):
    models: torch.Tensor
    """The K cluster models [K, d]."""
    delta: torch.Tensor
    """Each model's last update Δw_k [K, d] (JGL eq. 2)."""
    assign: np.ndarray
    """Each client's last cluster (−1: never chose)."""


CP = TypeVar("CP", bound=ClusterModelParams)


class ClusterModelAlgorithm(Algorithm[CP, ClusterModelState]):
    """Base class: K cluster models, client-side choice, per-cluster averaging."""

    cluster_count = "n_clusters"
    StateType = ClusterModelState

    def __init__(self, params: CP, ctx: Context) -> None:
        super().__init__(params, ctx)
        self.shared = shared_columns(params.shared_layers, ctx.layout, self.name)
        """The columns the K models share (``shared_layers``), or None."""

    def tie(self, models: torch.Tensor) -> torch.Tensor:
        """``models`` [K, d] with the shared columns set to the first model's (in place)."""
        if self.shared is not None:
            models[:, self.shared] = models[0, self.shared]
        return models

    def tied(self, payload: Payload) -> dict[str, torch.Tensor]:
        """Each [K, d] tensor of ``payload`` with the shared columns, for
        :attr:`Request.tied` (sent once); empty without sharing."""
        return {} if self.shared is None else dict.fromkeys(payload, self.shared)

    def init_state(self) -> ClusterModelState:
        k = self.params.n_clusters
        n = self.ctx.n_clients
        return ClusterModelState(
            self._initial_models(), torch.zeros(k, self.ctx.dim), np.full(n, -1, dtype=np.int64)
        )

    def _initial_models(self) -> torch.Tensor:
        p = self.params
        ctx = self.ctx
        if p.init == "same":
            return ctx.init_row.unsqueeze(0).repeat(p.n_clusters, 1)
        if p.init == "private":
            return self.tie(private_initial_models(ctx, p.n_clusters, p.private_start, self.name))
        models = self.tie(ctx.fresh_rows(p.n_clusters, "cluster-init/0"))
        if p.min_cluster_share <= 0.0:
            return models
        clients = np.flatnonzero(ctx.present)
        need = int(np.ceil(p.min_cluster_share * len(clients)))
        for attempt in range(p.max_redraws):
            if attempt:
                models = self.tie(ctx.fresh_rows(p.n_clusters, f"cluster-init/{attempt}"))
            loss = self.model_losses(
                models, clients, 0, "init", self.choice_batches(), measurement=True
            )["losses"]
            counts = np.bincount(loss.argmin(dim=1).numpy(), minlength=p.n_clusters)
            log.info(
                "%s: initial models, draw %d: clients per cluster %s", self.name, attempt, counts
            )
            if counts.min() >= need:
                return models
        log.warning(
            "%s: no initial models gave every cluster %d clients in %d draws; using the last",
            self.name,
            need,
            p.max_redraws,
        )
        return models

    def choose(self, state: ClusterModelState, rnd: int, selected: np.ndarray) -> Choice:
        """Cluster choice of the selected clients that answered the decision query."""
        raise NotImplementedError

    def choice_batches(self) -> str:
        """The data the decision query's losses are measured on (``one`` mini-batch or
        ``all``); the good initializer judges the initial models by the same losses."""
        return "one"

    def model_losses(
        self,
        models: torch.Tensor,
        clients: np.ndarray,
        rnd: int,
        purpose: str,
        batches: str = "one",
        measurement: bool = False,
    ) -> Replies:
        """The decision query: each client's loss of the K ``models`` [n, K]
        (:data:`~fedcluster.engine.client_computations.LOSSES`)."""
        tied = self.tied({"models": models})
        return loss_query(self.ctx, models, clients, rnd, purpose, batches, measurement, tied)

    def choose_and_train(
        self, state: ClusterModelState, rnd: int, selected: np.ndarray
    ) -> tuple[Replies, dict[str, float]]:
        """``choice_on_device``: the selected clients choose, train and upload in one
        message; the accepted replies (:meth:`ask_device_choice`) and what the choice
        reports for ``diagnostics.csv``."""
        raise NotImplementedError

    def ask_device_choice(
        self,
        computation: ClientComputation,
        state: ClusterModelState,
        rnd: int,
        selected: np.ndarray,
        rule: Settings,
        shared: Payload,
        pins: np.ndarray | None = None,
    ) -> Replies:
        """Ask ``selected`` to choose by ``rule`` among the K models (with ``shared``
        extras, e.g. JGL's Δw), train the chosen one and upload it with the cluster
        id; ``pins`` [n] (−1: free) allocates clients to a cluster instead. Exact
        ties are broken on the device from ``tie_seed`` (each client its own
        stream), so they depend on nothing but the round and the client. Returns
        the accepted replies (``row``, ``loss``, ``cluster``, ...)."""
        request = self.device_choice_request(state, rnd, rule, shared, pins)
        ints = self.upload_ints() - 1  # the cluster id travels in the reply
        return self.ctx.ask(computation, selected, request, rnd, metadata_ints=ints)

    def device_choice_request(
        self,
        state: ClusterModelState,
        rnd: int,
        rule: Settings,
        shared: Payload,
        pins: np.ndarray | None = None,
    ) -> Request:
        """The request of :meth:`ask_device_choice`: the K models, ``shared`` extras, the
        training, the round's tie seed and the ``rule`` (``pins``: one setting each)."""
        ctx = self.ctx
        own = None
        if pins is not None and (pins >= 0).any():
            own = tuple({"pin": int(k)} if k >= 0 else {} for k in pins)
        shared = {"models": state.models, **shared}
        return Request(
            shared=shared,
            settings={
                "train": ctx.train,
                "round": rnd,
                "tie_seed": derive_seed(ctx.seed, f"{self.name}/ties", rnd),
                **rule,
            },
            own_settings=own,
            tied=self.tied(shared),
        )

    def device_choice(
        self, state: ClusterModelState
    ) -> tuple[ClientComputation, Settings, Payload]:
        """The device choice a secure round asks for (``privacy.secure_aggregation``): the
        chosen-start training, its rule and its shared extras (:meth:`ask_device_choice`)."""
        raise NotImplementedError(f"{self.name}: no choice on the device under secure aggregation")

    def secure_round(
        self, state: ClusterModelState, rnd: int, selected: np.ndarray
    ) -> RoundOutput[ClusterModelState]:
        """A round under secure aggregation (:mod:`fedcluster.protocol.secure_sum`): the
        devices choose, train and contribute; the server receives each cluster's clipped
        sum and size only, and releases cluster k as W_k + (S_k + noise)/n_k in the order
        of the trusted server's :func:`cluster_average` (the same noise). Who chose
        which cluster stays unknown to the server (``assign`` is unchanged)."""
        computation, rule, shared = self.device_choice(state)
        request = self.device_choice_request(state, rnd, rule, shared)
        new, total = self.ctx.secure_total(computation, selected, request, rnd)
        released = replace(state, models=new, delta=new - state.models)
        return RoundOutput(released, total.mean_loss, {})

    def run_round(
        self, state: ClusterModelState, rnd: int, selected: np.ndarray
    ) -> RoundOutput[ClusterModelState]:
        ctx = self.ctx
        if ctx.secure:
            return self.secure_round(state, rnd, selected)
        if self.params.choice_on_device:
            replies, found = self.choose_and_train(state, rnd, selected)
            ex = Exchange(replies.keep, replies.clients, replies["row"], replies["loss"])
            choice = replies["cluster"].numpy().astype(np.int64)
            if not len(ex.clients):
                return RoundOutput(state, float("nan"), found)
            ctx.observe_uploads(ex.clients, state.models[torch.as_tensor(choice)], ex.rows)
        else:
            chosen = self.choose(state, rnd, selected)  # sends the K models (and JGL's updates)
            found = chosen.diagnostics
            choice = chosen.clusters
            ex = ctx.exchange(
                chosen.clients, state.models[choice], rnd, ints=self.upload_ints(), held=True
            )
            if not len(ex.clients):
                return RoundOutput(state, float("nan"), found)
            choice = choice[ex.keep]
        sizes = ctx.train_sizes[ex.clients]
        weights = sizes if self.params.weighting == "samples" else None
        old = state.models
        new = cluster_average(ex.rows, choice, old, weights, ctx.aggregate, shared=self.shared)
        assign = state.assign.copy()
        assign[ex.clients] = choice
        averaged = replace(state, models=new, delta=new - old, assign=assign)
        repaired, report = self.repair(averaged, rnd, old, ex, choice, weights)
        return RoundOutput(repaired, weighted_loss(ex.loss, sizes), {**report, **found})

    def repair(
        self,
        state: ClusterModelState,
        rnd: int,
        old: torch.Tensor,
        ex: Exchange,
        choice: np.ndarray,
        weights: np.ndarray | None,
    ) -> tuple[ClusterModelState, dict[str, float]]:
        """Opt-in cluster repair of the round's averaged ``state`` (:mod:`.repair`): the
        repaired state and the repair's diagnostics (``repair/c<k>/separation``,
        ``repair/splits``); ``state`` and no diagnostics when repair is off.

        ``old``: the models the clients trained from; ``ex``/``choice``: the
        accepted uploads and their clusters.
        """
        fixed = apply_repair(
            self.params.repair,
            rnd,
            old,
            state.models,
            state.delta,
            ex.rows,
            choice,
            weights,
            compared=self.ctx.compared,
        )
        if fixed is None:
            return state, {}
        models, delta = fixed.models, fixed.delta
        if self.shared is not None:  # the halves' averages keep the averaged shared layers
            models = models.clone()
            delta = delta.clone()
            models[:, self.shared] = state.models[0, self.shared]
            delta[:, self.shared] = state.delta[0, self.shared]
        assign = state.assign.copy()
        assign[ex.clients] = fixed.choice
        for split, target in fixed.splits:
            log.info("%s round %d: repair split cluster %d into %d", self.name, rnd, split, target)
        repaired = replace(state, models=models, delta=delta, assign=assign)
        return repaired, repair_diagnostics(fixed.separation, len(fixed.splits))

    def upload_ints(self) -> int:
        """Integers each client uploads besides its model (cluster id, sample count)."""
        return 2 if self.params.weighting == "samples" else 1

    def eval_rows(self, state: ClusterModelState) -> tuple[torch.Tensor, np.ndarray]:
        tied = self.tied({"models": state.models})
        return state.models, loss_choice(self.ctx, state.models, state.assign, tied)

    def clusters(self, state: ClusterModelState) -> np.ndarray:
        return state.assign.copy()

    def tie_rng(self, rnd: int) -> np.random.Generator:
        return numpy_rng(self.ctx.seed, f"{self.name}/ties", rnd)
