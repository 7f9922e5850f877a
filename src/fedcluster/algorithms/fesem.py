"""FeSEM: Xie, Long, Shen, Zhou, Wang, Jiang, "Multi-center federated learning",
arXiv:2005.01026, 2020 (federated stochastic expectation maximisation).

The server keeps K cluster centres (models) and minimises the expected L2
distance between clients' local models and their centres, stochastically over
the clients of each round:

1. every selected client receives the centre of its cluster, trains it
   locally and uploads its local model w_i;
2. E-step: the server assigns each local model to the nearest centre,
   r_i = argmin_k ‖w_i − w̃_k‖ (L2 distance between models, as CFLGT Sec. V-A
   and FedGroup Sec. V describe the baseline);
3. M-step: every centre that received clients becomes the average of their
   local models, w̃_k = Σ_i r_ik w_i / Σ_i r_ik (``weighting="samples"``
   weights by sample count instead); the others keep their model.

The paper alternates the two steps over the clients' *latest* local models;
here they run on the models this round's participants just uploaded, so the
server stores no client model and a client's assignment changes only when it
takes part.

Initial centres (the paper leaves this open): ``init="clients"`` (default) --
in the first round all selected clients train from the shared initial model
and the centres are K of their local models chosen by k-means++ seeding (D²
sampling, Arthur & Vassilvitskii 2007, on the L2 distances), so clear groups
are unlikely to share a seed; ``init="random"`` -- K independently initialised
models, as FedGroup's reference implementation of this baseline does. A client
that has no cluster yet trains from the mean of the centres (in the first
round of ``init="clients"``, the shared initial model) and is evaluated with
it.

Rejected uploads (:meth:`~fedcluster.algorithms.base.Context.exchange`) take
no part in the E- and M-steps; those clients keep their cluster. A round
without an accepted model changes nothing; with ``init="clients"``, a first
round with fewer than K accepted models seeds no centres, and the next round
tries again from the shared initial model.

Cluster repair (beyond the paper, opt-in: ``repair:``,
:mod:`fedcluster.algorithms.repair`): after the M-step, a centre whose
members' updates (each from the model it trained from) split into two
incongruent halves gives its smaller half to a starved centre. FeSEM's
delta-free state ignores the repair's Δw.

The E-step on the device (``choice_on_device``, beyond the paper): each selected
client trains from its centre, then computes the same distance from its local model
to the K released centres and uploads its model with the nearest centre's id; the
server's M-step is unchanged and never compares individual models, which is what
lets FeSEM run under central DP (:mod:`fedcluster.privacy.central`: the choice costs
no budget, each clipped update joins one centre's sum). Its centres start as K
random models (``init: random``) or the private start (``init: private``, the
groups of a DP clustering of the clients' first updates,
:mod:`fedcluster.privacy.private_start`): k-means++ seeding on the clients'
models is a server-side look at individual updates.

Dynamic federations (:mod:`fedcluster.experiment.scenario`). A newcomer is a client
without a cluster: it trains from the mean of the centres and the E-step
assigns it to the nearest centre, as any client (Xie et al. need no special
rule). With ``init="clients"``, fewer than K selected clients in the seeding
round is a configuration error when every client was reachable (the
participation is too small ever to seed), and otherwise a round to wait.
Drift: the E-step re-assigns every participant each round, so a drifting
client moves to the centre nearest its new local model by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from fedcluster.algorithms.aggregation import cluster_average, eval_rows_with_average
from fedcluster.algorithms.base import (
    Algorithm,
    AlgorithmParams,
    Exchange,
    RoundOutput,
    State,
    register,
    weighted_loss,
)
from fedcluster.algorithms.cluster_count import AUTO_HELP
from fedcluster.algorithms.cluster_models import private_initial_models
from fedcluster.algorithms.repair import ClusterRepair, apply_repair, repair_diagnostics
from fedcluster.clustering.distances import euclidean_distance_matrix
from fedcluster.engine.client_computations import TRAIN, cluster_ids_in_range
from fedcluster.errors import ConfigError
from fedcluster.privacy.private_start import PrivateStart, private_start_field
from fedcluster.protocol.client_side import ClientBatch
from fedcluster.protocol.computation import Payload, ReplyField, Request, register_computation
from fedcluster.rng import numpy_rng


class FeSEMParams(AlgorithmParams):
    n_clusters: int = Field(
        5, ge=1, description="number of centres K (CFLGT scenario 1: 5)" + AUTO_HELP
    )
    init: Literal["clients", "random", "private"] = Field(
        "clients",
        description="centres: k-means++ seeds among the first round's local models, "
        "independent random models, or the private start (DP clustering of first updates)",
    )
    private_start: PrivateStart = private_start_field()
    weighting: Literal["uniform", "samples"] = Field(
        "uniform", description="M-step average: uniform (FeSEM) or by sample count"
    )
    repair: ClusterRepair | None = Field(
        None, description="split incongruent clusters into starved ones (repair.py; None: off)"
    )
    choice_on_device: bool = Field(
        False,
        description="the device runs the E-step: after training it picks the released centre "
        "nearest its model and uploads both (needs init: random or private)",
    )


def _train_and_choose(batch: ClientBatch, request: Request) -> Payload:
    """Train from each client's own start, then the E-step on the device: the released
    centre nearest the trained model (the server's distance, on the compared part)."""
    s = request.settings
    training = Request(
        own={"start": request.own["start"]}, settings={"train": s["train"], "round": s["round"]}
    )
    trained = TRAIN.compute(batch, training)
    centres = request.shared["centres"]
    width = batch.layout.param_dim if s["compare"] == "parameters" else batch.dim
    choice = [
        int(euclidean_distance_matrix(torch.cat([row[None], centres])[:, :width])[0, 1:].argmin())
        for row in trained["row"]
    ]
    return {**trained, "cluster": torch.as_tensor(choice, dtype=torch.int32)}


TRAIN_AND_CHOOSE = register_computation(
    replace(  # a training (its DP release, cost and update bound) that reports its E-step
        TRAIN,
        name="fesem-train-and-choose",
        reply={**TRAIN.reply, "cluster": ReplyField((), dtype=torch.int32)},
        batched_run=_train_and_choose,
        check=cluster_ids_in_range("centres"),
    )
)
"""FeSEM with ``choice_on_device``: local training from the client's centre, then the
E-step on the device against the K released centres; uploads the model and the centre id
(the model and one int32 counted)."""


def kmeanspp_seeds(distance: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of ``k`` points chosen by k-means++ D² sampling from a distance matrix [n, n].

    The first seed is uniform; each next one is drawn with probability
    proportional to its squared distance to the nearest seed so far (uniform
    among the unchosen points when all remaining distances are 0).
    """
    n = len(distance)
    chosen = [int(rng.integers(n))]
    nearest = distance[chosen[0]] ** 2
    for _ in range(1, k):
        weight = nearest.copy()
        if weight.sum() <= 0.0:
            weight = np.ones(n)
            weight[chosen] = 0.0
        chosen.append(int(rng.choice(n, p=weight / weight.sum())))
        nearest = np.minimum(nearest, distance[chosen[-1]] ** 2)
    return np.array(chosen, dtype=np.int64)


@dataclass
class FeSEMState(State):
    centres: torch.Tensor
    """The K cluster centres (models) [K, d]."""
    assign: np.ndarray
    """Each client's cluster (−1: not yet assigned)."""
    seeded: bool
    """Whether the centres have been seeded (k-means++ on the first models)."""


@register
class FeSEM(Algorithm[FeSEMParams, FeSEMState]):
    """FeSEM (Xie et al. 2020): stochastic EM of clients' local models around K centres."""

    name = "fesem"
    Params = FeSEMParams
    cluster_count = "n_clusters"
    StateType = FeSEMState

    def init_state(self) -> FeSEMState:
        ctx = self.ctx
        p = self.params
        if p.choice_on_device and p.init == "clients":
            raise ConfigError(
                "fesem.choice_on_device: the device chooses among released centres, so they "
                "cannot be seeded from the clients' models; set init: random or private"
            )
        if p.init == "random":
            centres = ctx.fresh_rows(p.n_clusters, "fesem/centres")
        elif p.init == "private":
            centres = private_initial_models(ctx, p.n_clusters, p.private_start, self.name)
        else:
            centres = ctx.init_row.unsqueeze(0).repeat(p.n_clusters, 1)
        seeded = p.init != "clients"
        return FeSEMState(centres, np.full(ctx.n_clients, -1, dtype=np.int64), seeded)

    def run_round(
        self, state: FeSEMState, rnd: int, selected: np.ndarray
    ) -> RoundOutput[FeSEMState]:
        ctx = self.ctx
        p = self.params
        if not state.seeded and len(selected) < p.n_clusters:
            if not ctx.available.all():  # wait for enough reachable clients (module docstring)
                return RoundOutput(state, float("nan"))
            raise ConfigError(
                f"fesem.n_clusters: init='clients' needs at least {p.n_clusters} clients "
                f"in the first round, got {len(selected)}"
            )
        rows, owner = eval_rows_with_average(state.centres, state.assign)
        if p.choice_on_device:
            ex, device_choice = self.train_and_choose(state, rows[owner[selected]], rnd, selected)
        else:
            ex = ctx.exchange(
                selected, rows[owner[selected]], rnd, ints=int(p.weighting == "samples")
            )
        selected, local, m = ex.clients, ex.rows, len(ex.clients)
        sizes = ctx.train_sizes[selected]
        loss = weighted_loss(ex.loss, sizes)
        if m == 0 or (not state.seeded and m < p.n_clusters):
            return RoundOutput(state, loss)  # too few accepted models: nothing changes
        old = state.centres
        if p.choice_on_device:
            choice = device_choice  # the devices' E-step
        else:
            old, choice = self.e_step(state, local)
        weights = sizes if p.weighting == "samples" else np.ones(m)
        centres, choice = self.m_step(local, choice, old, weights)
        report: dict[str, float] = {}
        if p.repair is not None:  # FeSEM keeps no Δw: the repair's is zeros and dropped
            starts = rows[owner[selected]]  # the model each client trained from
            fixed = apply_repair(
                p.repair,
                rnd,
                old,
                centres,
                torch.zeros_like(old),
                local,
                choice,
                weights,
                starts,
                ctx.compared,
            )
            assert fixed is not None
            centres, choice = fixed.models, fixed.choice
            report = repair_diagnostics(fixed.separation, len(fixed.splits))
        assign = state.assign.copy()
        assign[selected] = choice
        new = replace(state, centres=centres, assign=assign, seeded=True)
        return RoundOutput(new, loss, report)

    def e_step(self, state: FeSEMState, local: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
        """The server's E-step (module docstring): the centres (seeded by k-means++ among
        ``local`` in the first round) and each local model's nearest centre."""
        ctx, p, m = self.ctx, self.params, len(local)
        pair = euclidean_distance_matrix(ctx.compared(torch.cat([local, state.centres]))).numpy()
        if state.seeded:
            return state.centres, pair[:m, m:].argmin(axis=1)
        seeds = kmeanspp_seeds(pair[:m, :m], p.n_clusters, numpy_rng(ctx.seed, "fesem/seeds"))
        return local[seeds].clone(), pair[:m, seeds].argmin(axis=1)

    def train_and_choose(
        self, state: FeSEMState, starts: torch.Tensor, rnd: int, selected: np.ndarray
    ) -> tuple[Exchange, np.ndarray]:
        """``choice_on_device``: the selected clients train from ``starts`` [n, d], choose
        the nearest released centre and upload both; the accepted uploads (entered in
        central DP's ledger) and their centres."""
        ctx = self.ctx
        request = Request(
            shared={"centres": state.centres},
            own={"start": starts},
            settings={"train": ctx.train, "round": rnd, "compare": ctx.compare},
        )
        ints = int(self.params.weighting == "samples")
        replies = ctx.ask(TRAIN_AND_CHOOSE, selected, request, rnd, metadata_ints=ints)
        kept = starts[torch.as_tensor(replies.keep)]
        ctx.observe_uploads(replies.clients, kept, replies["row"])
        ex = Exchange(replies.keep, replies.clients, replies["row"], replies["loss"])
        return ex, replies["cluster"].numpy().astype(np.int64)

    def m_step(
        self, local: torch.Tensor, choice: np.ndarray, centres: torch.Tensor, weights: np.ndarray
    ) -> tuple[torch.Tensor, np.ndarray]:
        """M-step: every centre with members becomes their (weighted) average; returns
        the centres and the members' clusters (unchanged here)."""
        return cluster_average(local, choice, centres, weights, self.ctx.aggregate), choice

    def eval_rows(self, state: FeSEMState) -> tuple[torch.Tensor, np.ndarray]:
        return eval_rows_with_average(state.centres, state.assign)

    def clusters(self, state: FeSEMState) -> np.ndarray:
        return state.assign.copy()
