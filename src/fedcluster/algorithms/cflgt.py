"""CFLGT: clustered FL with gradient trajectory (the CFLGT paper, Alg. 1).

Schedule (Alg. 1), one runner round per step:

1. rounds ``1..K`` (``pretrain_rounds``, lines 2-4): FedAvg of the global
   model h_g with the runner's selected clients (Alg. 1 line 3,
   ``FedAvg(h_g, M)``, under the run's participation);
2. round ``K + 1`` (lines 5-11): the server broadcasts h_g to *every* client;
   each computes its gradient trajectory with a forward pass
   (:func:`~fedcluster.algorithms.cflgt_trajectory.gradient_trajectories`, eqs. 6-8) and
   uploads its 2·C floats; the server clusters the trajectories by affinity
   propagation on the negative mean L2 distance between corresponding points
   (Sec. IV-B) -- the number of clusters is found, not given -- and every
   cluster model starts as h_g. No client trains in this round, so its
   training loss is NaN; its bytes and client time are the cost of the
   clustering step alone (the quantities of Fig. 8);
3. later rounds (lines 12-24): each cluster runs FedAvg (eq. 2) with its
   members among the round's participants U^t; clients never change cluster
   (Sec. V-A: "each client will not be moved to another group").

Participants after clustering. Alg. 1 line 13 draws U^t as "a random subset of
clients M" -- one subset of all clients, routed to their clusters -- and
Sec. V-A uses 20% of the clients per round. ``cluster_fraction`` draws that
subset here (``max(1, round(f·M))`` clients, from ``numpy_rng(seed,
"cflgt/participants", round)``) and the runner's selection is then ignored;
``sampling="per-cluster"`` instead draws ``max(1, round(f·|cluster|))`` of
every cluster's members, so each cluster trains every round (not in the
paper); ``cluster_fraction=None`` uses the runner's selection as U^t. For the
paper's protocol, set the run's participation to 0.2 as well, so pre-training
also uses 20% of the clients.

The clustering's record, kept in the state (newcomers are placed by the
trajectories; the run directory saves them and ``cv`` when the job ends, and
every round's diagnostics report ``cv_z1``, ``cv_z2`` and ``hopkins``):
``state.trajectories`` (float32 [M, C, 2], the accepted clients' in client
order), ``state.cv`` (coefficient
of variation of the Z1' and Z2' coordinates of all points, Sec. III-C) and
``state.hopkins`` (Hopkins statistic of the flattened trajectories
[M, 2·C], Sec. IV-D; > 0.75 reads as a clustering tendency). All three are
``None`` before the clustering round.

:class:`OneShotClustering` holds the schedule shared with FL+HC
(:mod:`fedcluster.algorithms.flhc`): CFLGT's comparison protocol clusters
every baseline once, after the same pre-training, with all clients (Sec. V-A).

Rejected uploads. Pre-training and per-cluster FedAvg leave rejected models
out (:meth:`~fedcluster.algorithms.base.Context.exchange`); a cluster none of
whose participants was accepted keeps its model. In the clustering round the
upload (FL+HC's model, CFLGT's trajectory) of every client is checked the same
way: non-finite ones are rejected (logged, ``ctx.rejected``) and only the
accepted clients are clustered. A rejected client stays unassigned (−1) for
good (``state.excluded``): it trains no more and is evaluated with the
pre-trained global model h_g. If no client can be clustered (every upload
rejected, or for FL+HC fewer accepted updates than clusters), the state is
unchanged and the next round repeats the clustering round.

Dynamic federations (:mod:`fedcluster.experiment.scenario`). "Every client" of the
clustering round is every client the server can reach in that round
(``ctx.available``); participants are drawn among reachable clients too.
Clients that joined later, or were unreachable or failed in the clustering
round, are *newcomers* when they are first drawn afterwards: each subclass
places them by its own upload (:meth:`OneShotClustering.place_newcomers`), and
they then train with their cluster in the same round. A newcomer whose upload
fails or is rejected stays unassigned and is a newcomer again when next drawn.
CFLGT and Briggs et al. define no newcomer rule (CFLGT Sec. VI names it
future work), so both rules are extensions:

- CFLGT: the newcomer receives h_g, computes its trajectory at h_g (the model
  the members' trajectories were computed at) and joins the cluster whose
  members' trajectories are nearest on average (the distance of Sec. IV-B);
- FL+HC: the newcomer trains from h_g like the clients of the clustering round
  and joins the cluster whose mean clustering-round update ΔW is nearest
  (euclidean, the metric of the hierarchical clustering).

Drift: no reaction. Clients never change cluster after the clustering round
(CFLGT Sec. V-A: "each client will not be moved to another group"; FL+HC
clusters once as well).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, replace
from typing import Literal, TypeVar

import numpy as np
import torch
from pydantic import Field

from fedcluster.algorithms.base import (
    Algorithm,
    AlgorithmParams,
    RoundOutput,
    register,
    weighted_loss,
)
from fedcluster.algorithms.cflgt_trajectory import gradient_trajectories
from fedcluster.algorithms.fedavg import FedAvgState, fedavg_step
from fedcluster.clustering.distances import trajectory_distance_matrix, trajectory_distance_to
from fedcluster.clustering.methods import affinity_propagation
from fedcluster.clustering.validity import coefficient_of_variation, hopkins
from fedcluster.engine.client_computations import vector_release
from fedcluster.protocol.client_side import ClientBatch
from fedcluster.protocol.computation import (
    ClientComputation,
    Payload,
    ReplyField,
    Request,
    register_computation,
)
from fedcluster.rng import numpy_rng


def _trajectory(batch: ClientBatch, request: Request) -> Payload:
    row, normalise = request.shared["model"], bool(request.settings["normalise"])
    return {"trajectory": gradient_trajectories(batch, row, normalise)}


def _classes(request: Request) -> tuple[int, ...]:
    return (int(request.settings["n_classes"]), 2)


TRAJECTORY = register_computation(
    ClientComputation(
        name="cflgt-trajectory",
        reply={"trajectory": ReplyField(_classes)},
        batched_run=_trajectory,
        privacy="release",
        release=vector_release("trajectory", "trajectory"),
    )
)
"""CFLGT's client computation (Sec. III, eqs. 6-8): the client's gradient trajectory
[C, 2] under the received model, from one forward pass over its training data."""


class OneShotParams(AlgorithmParams):
    pretrain_rounds: int = Field(
        25, ge=0, description="FedAvg rounds before clustering (CFLGT Sec. V-A: 25)"
    )


@dataclass
class OneShotState(FedAvgState):
    models: torch.Tensor
    """Cluster models [K, d], empty before clustering."""
    assign: np.ndarray
    """Each client's cluster, −1 before clustering."""
    excluded: np.ndarray
    """Clients whose clustering-round upload was rejected."""


@dataclass
class CFLGTState(OneShotState):
    trajectories: torch.Tensor | None = None
    """The accepted clients' trajectories [M, C, 2] (None before clustering)."""
    trajectory_clients: np.ndarray | None = None
    cv: np.ndarray | None = None
    hopkins: float | None = None


OP = TypeVar("OP", bound=AlgorithmParams)
OS = TypeVar("OS", bound=OneShotState)


class OneShotClustering(Algorithm[OP, OS]):
    """Pre-train FedAvg, cluster all clients once, then per-cluster FedAvg.

    State: ``global`` (the pre-trained model [d]), ``models`` (cluster models
    [K, d], empty before clustering), ``assign`` (cluster of every client,
    −1 before clustering) and ``excluded`` (clients whose clustering-round
    upload was rejected). Subclasses provide :meth:`cluster_clients` and
    :meth:`place_newcomers` and may override :meth:`participants` and
    :meth:`clustering_report`.
    """

    def init_state(self) -> OS:
        return self.StateType(
            global_model=self.ctx.init_row.clone(),
            models=torch.empty(0, self.ctx.dim),
            assign=np.full(self.ctx.n_clients, -1, dtype=np.int64),
            excluded=np.zeros(self.ctx.n_clients, dtype=bool),
        )

    @staticmethod
    def clustered(state: OneShotState) -> bool:
        return len(state.models) > 0

    def pretraining(self) -> int:
        """The FedAvg rounds before the clustering round (``pretrain_rounds``; none without)."""
        return self.params.pretrain_rounds if isinstance(self.params, OneShotParams) else 0

    def run_round(self, state: OS, rnd: int, selected: np.ndarray) -> RoundOutput[OS]:
        if rnd <= self.pretraining():
            state, loss = self.pretrain_round(state, rnd, selected)
        elif not self.clustered(state):
            state, loss = self.clustering_round(state, rnd)
        else:
            state, loss = self.clustered_round(state, rnd, selected)
        return RoundOutput(state, loss, self.clustering_report(state))

    def pretrain_round(self, state: OS, rnd: int, selected: np.ndarray) -> tuple[OS, float]:
        """One FedAvg round of the global model (:func:`.fedavg.fedavg_step`)."""
        ctx = self.ctx
        model, ex = fedavg_step(ctx, state.global_model, rnd, selected, ctx.local(mu=0.0))
        loss = weighted_loss(ex.loss, ctx.train_sizes[ex.clients])
        return replace(state, global_model=model), loss

    def clustering_round(self, state: OS, rnd: int) -> tuple[OS, float]:
        """Cluster the reachable clients once; every cluster model starts as the global
        model. Returns the new state and the round's loss (NaN when no client trained)."""
        state, labels, loss = self.cluster_clients(state, rnd)
        if (labels >= 0).any():
            excluded = state.excluded.copy()
            excluded[self.ctx.rejected] = True
            models = state.global_model.unsqueeze(0).repeat(int(labels.max()) + 1, 1)
            state = replace(state, assign=labels, models=models, excluded=excluded)
        return state, loss

    def clustered_round(self, state: OS, rnd: int, selected: np.ndarray) -> tuple[OS, float]:
        """Place the participants that are newcomers, then one FedAvg round per cluster."""
        participants = self.participants(state, rnd, selected)
        assign = state.assign
        newcomers = participants[(assign[participants] < 0) & ~state.excluded[participants]]
        if len(newcomers):
            assign = assign.copy()
            assign[newcomers] = self.place_newcomers(state, newcomers, rnd)
            state = replace(state, assign=assign)
        return self.cluster_fedavg(state, rnd, participants)

    @abstractmethod
    def cluster_clients(self, state: OS, rnd: int) -> tuple[OS, np.ndarray, float]:
        """Cluster the reachable clients from ``state.global_model``: the state with what
        the subclass keeps of the clustering, the labels 0..K−1 of every client, the
        round's loss.

        −1 labels a client not clustered (unreachable, failed, or its upload
        rejected); all −1 means that nothing could be clustered (the next
        round tries again).
        """

    @abstractmethod
    def place_newcomers(self, state: OS, clients: np.ndarray, rnd: int) -> np.ndarray:
        """The cluster of each newcomer in ``clients`` (−1: its upload failed or was rejected)."""

    def participants(self, state: OS, rnd: int, selected: np.ndarray) -> np.ndarray:
        """The clients that train in a clustered round (default: the runner's selection)."""
        return selected

    def clustering_report(self, state: OS) -> dict[str, float]:
        """What every round's diagnostics report about the state's clustering (default: nothing)."""
        return {}

    def cluster_fedavg(self, state: OS, rnd: int, participants: np.ndarray) -> tuple[OS, float]:
        """One FedAvg round per cluster with its members among ``participants``
        (:func:`~fedcluster.algorithms.fedavg.fedavg_step`)."""
        ctx = self.ctx
        models = list(state.models)
        exchanges = []
        for c in range(len(models)):
            members = participants[state.assign[participants] == c]
            if len(members) == 0:
                continue
            models[c], ex = fedavg_step(ctx, state.models[c], rnd, members, ctx.local(mu=0.0))
            exchanges.append(ex)
        if not exchanges:
            return state, float("nan")
        clients = np.concatenate([ex.clients for ex in exchanges])
        loss = torch.cat([ex.loss for ex in exchanges])
        return replace(state, models=torch.stack(models)), weighted_loss(
            loss, ctx.train_sizes[clients]
        )

    def eval_rows(self, state: OS) -> tuple[torch.Tensor, np.ndarray]:
        """Cluster models; clients without a cluster use the pre-trained global model."""
        models, assign = state.models, state.assign
        if (assign >= 0).all():
            return models, assign.copy()
        rows = torch.cat([models, state.global_model.unsqueeze(0)])
        return rows, np.where(assign >= 0, assign, len(models)).astype(np.int64)

    def clusters(self, state: OS) -> np.ndarray:
        return state.assign.copy()


class CFLGTParams(OneShotParams):
    preference: float | Literal["median"] = Field(
        "median",
        description="affinity propagation preference: higher gives more clusters "
        "(median of the similarities = Frey & Dueck's default)",
    )
    damping: float = Field(0.5, ge=0.5, lt=1.0, description="affinity propagation damping")
    normalise: bool = Field(
        True, description="divide each client's forces by its sample count (else sizes split)"
    )
    cluster_fraction: float | None = Field(
        0.2,
        gt=0.0,
        le=1.0,
        description="share of clients training per clustered round (Sec. V-A: 20%); "
        "None: the runner's selection",
    )
    sampling: Literal["global", "per-cluster"] = Field(
        "global",
        description="draw cluster_fraction of all clients (Alg. 1 line 13) or of each cluster",
    )


@register
class CFLGT(OneShotClustering[CFLGTParams, CFLGTState]):
    """CFLGT (Alg. 1): FedAvg pre-training, trajectory clustering by AP, per-cluster FedAvg."""

    name = "cflgt"
    Params = CFLGTParams
    StateType = CFLGTState

    def trajectories(
        self, state: CFLGTState, clients: np.ndarray, rnd: int
    ) -> tuple[np.ndarray, torch.Tensor]:
        """Clients receive h_g and upload their trajectories (eqs. 6-8): accepted ids and [m, C, 2].

        Costs each client h_g down and 2·C floats up (if it replies); under
        client-level local DP the trajectory is released like any upload.
        """
        settings = {
            "normalise": self.params.normalise,
            "n_classes": self.ctx.federation.n_classes,
            "round": rnd,
        }
        request = Request(shared={"model": state.global_model}, settings=settings)
        replies = self.ctx.ask(TRAJECTORY, clients, request, rnd)
        return replies.clients, replies["trajectory"]

    def cluster_clients(self, state: CFLGTState, rnd: int) -> tuple[CFLGTState, np.ndarray, float]:
        ctx = self.ctx
        p = self.params
        clients, traj = self.trajectories(state, ctx.available_clients(), rnd)
        labels = np.full(ctx.n_clients, -1, dtype=np.int64)
        if not len(clients):
            return state, labels, float("nan")
        labels[clients] = affinity_propagation(
            -trajectory_distance_matrix(traj),
            preference=p.preference,
            damping=p.damping,
            random_state=int(numpy_rng(ctx.seed, "cflgt/affinity").integers(2**31)),
        )
        cv = coefficient_of_variation(traj.reshape(-1, 2), axis=0)
        tendency = state.hopkins
        if len(traj) >= 2:
            tendency = hopkins(traj.flatten(1), rng=numpy_rng(ctx.seed, "cflgt/hopkins"))
        clustered = replace(
            state, trajectories=traj, trajectory_clients=clients, cv=cv, hopkins=tendency
        )
        return clustered, labels, float("nan")

    def place_newcomers(self, state: CFLGTState, clients: np.ndarray, rnd: int) -> np.ndarray:
        """Nearest cluster by mean trajectory distance to its members (module docstring)."""
        labels = np.full(len(clients), -1, dtype=np.int64)
        accepted, traj = self.trajectories(state, clients, rnd)
        if not len(accepted):
            return labels
        assert state.trajectories is not None and state.trajectory_clients is not None
        dist = trajectory_distance_to(traj, state.trajectories)  # [m, M]
        member_of = state.assign[state.trajectory_clients]
        k = len(state.models)
        mean = torch.stack([dist[:, member_of == c].mean(dim=1) for c in range(k)], dim=1)
        labels[np.isin(clients, accepted)] = mean.argmin(dim=1).numpy()
        return labels

    def clustering_report(self, state: CFLGTState) -> dict[str, float]:
        """``cv_z1``, ``cv_z2`` and ``hopkins`` of the clustering round's trajectories."""
        if state.trajectories is None:
            return {}
        cv = np.asarray(state.cv, dtype=np.float64)
        out = {"cv_z1": float(cv[0]), "cv_z2": float(cv[1])}
        if state.hopkins is not None:
            out["hopkins"] = float(state.hopkins)
        return out

    def artifacts(self, state: CFLGTState) -> dict[str, np.ndarray]:
        if state.trajectories is None:
            return {}
        return {"trajectories": np.asarray(state.trajectories), "cv": np.asarray(state.cv)}

    def participants(self, state: CFLGTState, rnd: int, selected: np.ndarray) -> np.ndarray:
        p = self.params
        if p.cluster_fraction is None:
            return selected
        rng = numpy_rng(self.ctx.seed, "cflgt/participants", rnd)
        reachable = self.ctx.available
        if p.sampling == "global":
            groups = [np.flatnonzero(reachable)]
        else:  # each cluster, then the clients without one (newcomers)
            labels = np.where(state.excluded, -2, state.assign)
            order = [*range(len(state.models)), -1]
            groups = [np.flatnonzero(reachable & (labels == c)) for c in order]
        drawn = [
            rng.choice(g, max(1, round(p.cluster_fraction * len(g))), replace=False)
            for g in groups
            if len(g)
        ]
        return np.sort(np.concatenate(drawn)) if drawn else np.empty(0, np.int64)
