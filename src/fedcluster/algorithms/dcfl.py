"""DCFL: Augello, Falzone, Lo Re, "DCFL: dynamic clustered federated learning
under differential privacy settings", PerCom Workshops 2023, Alg. 1.

- Every selected client trains from its cluster's model and uploads its
  update vector δ_i, origin = the model received (A), end = the model after
  local training (B) (Sec. II-B). Clients of different clusters start from
  different models, which is what DCFL's distance is for: the pairwise
  distance d(δ_i, δ_j) = |BD|·e^{2ω} with the divergence ω of eq. 1 (eq. 2)
  compares whole update vectors, origins included
  (:func:`~fedcluster.clustering.distances.dcfl_distance_matrix`; ``variant``
  selects Table II's ablation: complete, divergence, cosine, euclidean).
- Each cluster model is updated with its members' updates (Alg. 1 line 17),
  then the Dunn index DI of the current clustering on the round's distances is
  computed (eq. 3, single-linkage inter / maximal intra-cluster distance;
  :func:`~fedcluster.clustering.validity.dunn_index`); when there is one
  cluster or DI < 1 (eq. 4), the round's updates are re-clustered by affinity
  propagation on −d (Frey & Dueck; the number of clusters is found, set by
  ``preference``) and each new cluster model is the average of its members'
  models (eq. 5).
- Round 1 (Alg. 1 lines 1-3): all initial clients form one cluster C_0 whose
  model is the random initial model W_G; they train, and since |C| = 1 the
  first clustering happens at the end of round 1.
- A newcomer (eq. 6, Alg. 1 lines 5-9) receives the average of the cluster
  models W_G = Σ_j W_{C_j} / |C|, trains one round from it and joins the
  cluster k minimising d(δ_{C_k}, δ_{n+1}), δ_{C_k} the vector W_G → W_{C_k}
  (:meth:`DCFL.assign_newcomer`); it then trains with its cluster as usual.

Choices where the paper is silent, taken here:

- The initial set of clients is the round-1 participants; a client first
  selected later is a newcomer (under full participation: nobody).
- Averages are uniform over clients (eq. 5; line 17 is read the same way, so
  without re-clustering a cluster's model is its members' average model).
- The paper lets every client take part in every round ("future works will
  address settings where only a portion ... participate"). With partial
  participation, clustering uses the participants' updates; on re-clustering
  an absent client follows the new cluster that most of its old cluster's
  participants joined, and a cluster none of whose members took part is kept
  unchanged. Clusters without participants keep their models.
- Clients never assigned are evaluated with W_G, the model a newcomer gets.
- Rejected updates (:meth:`~fedcluster.algorithms.base.Context.exchange`):
  a rejected client counts as absent (above); distances, the Dunn index,
  affinity propagation and the averages use the accepted updates only. The
  round-1 participants form C_0 whatever their uploads. A rejected newcomer
  stays unassigned, skips the round and is a newcomer again when next
  selected. A round without an accepted update changes nothing.
- Large rounds (not in the paper, whose federations have tens of clients):
  with more than ``max_exact_participants`` accepted updates (default 500),
  the distances, the Dunn index and affinity propagation are computed on a
  seeded random sample of that many, and every other update joins the
  cluster of its nearest exemplar by eq. 2 (affinity propagation's own
  assignment rule). That keeps the O(n²) steps at O(s²) + O(n·K): at 1,000
  participants of 10,000 clients they were half the round
  (docs/benchmarks.md). While the sample holds two clusters or more, its
  Dunn index is never below the full one (fewer pairs in its minimum and its
  maximum), so it re-clusters no more often. A sample needs several members
  of every group: with two of each (8 of 20 rotated-MNIST clients in
  tests/algorithms/test_dcfl.py) two groups can stay merged, with three or
  more they were found as by the exact clustering. ``null`` keeps every
  round exact.
- The round's diagnostics: ``dunn``, the DI that decided the round (that of
  the clustering in force during the round), and ``reclusterings``, the
  re-clusterings so far (``state.reclusterings``).

The choice on the device (``choice_on_device``, beyond the paper;
:mod:`fedcluster.algorithms.direction_choice`): every selected client runs eq. 6 every
round on its device -- trains a probe from W_G, joins the cluster whose released
direction (its last released step) is nearest by eq. 2 with the expected noise of that
direction subtracted, trains that cluster's model and uploads it with the cluster id --
and the server only averages each cluster, so DCFL runs under central DP without
sketches. There are ``n_clusters`` clusters from K random initial models; affinity
propagation and the Dunn-index re-clustering (eqs. 3-5) compare individual updates and
do not run (setting ``preference``, ``damping`` or ``max_exact_participants`` with it is
refused), and there are no newcomers (every client chooses).

Dynamic federations (:mod:`fedcluster.experiment.scenario`), the setting DCFL was built
for (Sec. III): a client joining after round 1 is a newcomer when first
selected (eq. 6 above); a failed newcomer is treated like a rejected one. A
drifting client's update leaves its cluster, the Dunn index drops below 1 and
the round's updates are re-clustered (eq. 4), which moves the client -- the
paper's reaction to drift, nothing else is needed.
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
    RoundOutput,
    State,
    register,
    weighted_loss,
)
from fedcluster.algorithms.cluster_models import loss_choice
from fedcluster.algorithms.direction_choice import (
    DeviceStartParams,
    direction_round,
    initial_cluster_models,
    initial_directions,
)
from fedcluster.clustering.distances import DcflVariant, dcfl_distance_matrix, dcfl_distance_to
from fedcluster.clustering.methods import affinity_propagation_exemplars
from fedcluster.clustering.validity import dunn_index
from fedcluster.rng import numpy_rng


@dataclass
class DCFLState(State):
    models: torch.Tensor
    """The cluster models W_Ck [K, d]."""
    assign: np.ndarray
    """Each client's cluster (−1: not yet assigned)."""
    reclusterings: int
    """The re-clusterings so far."""
    directions: torch.Tensor
    """With ``choice_on_device``: each cluster's last released step [K, d] (its offset from
    W_G before its first aggregation); empty otherwise."""
    direction_noise: torch.Tensor
    """The per-coordinate noise std of each direction [K] (central DP); empty otherwise."""


class DCFLParams(DeviceStartParams):
    variant: DcflVariant = Field(
        "complete",
        description="distance of Table II: complete (eq. 2), divergence, cosine or euclidean",
    )
    preference: float | Literal["median"] = Field(
        "median",
        description="affinity-propagation preference on −distance (higher: more clusters)",
    )
    damping: float = Field(0.5, ge=0.5, lt=1.0, description="affinity-propagation damping")
    max_exact_participants: int | None = Field(
        500,
        ge=2,
        description="above this many accepted updates in a round, the Dunn index and "
        "affinity propagation run on a random sample of this many and the others join "
        "their nearest exemplar (O(s²) instead of O(n²)); null: always exact",
    )
    choice_on_device: bool = Field(
        False,
        description="every client runs eq. 6 on its device each round (probe from W_G, the "
        "nearest released cluster step by eq. 2 less its expected noise) and uploads its model "
        "with the cluster id; no affinity propagation or re-clustering",
    )
    n_clusters: int | None = Field(
        None, ge=1, description="with choice_on_device: the K random initial clusters (default 4)"
    )

    @model_validator(mode="after")
    def _device_settings(self) -> DCFLParams:
        if not self.choice_on_device:
            if self.n_clusters is not None:
                raise ValueError(
                    "n_clusters needs choice_on_device: DCFL finds its clusters by affinity "
                    "propagation"
                )
            return self
        fields = type(self).model_fields
        server_side = [
            name
            for name in ("preference", "damping", "max_exact_participants")
            if getattr(self, name) != fields[name].default
        ]
        if server_side:
            raise ValueError(
                f"{server_side[0]} has no effect with choice_on_device: affinity propagation "
                "and the Dunn-index re-clustering compare individual updates and do not run"
            )
        return self

    @property
    def device_clusters(self) -> int:
        """K of the device choice (``n_clusters``, default 4)."""
        return 4 if self.n_clusters is None else self.n_clusters


@register
class DCFL(Algorithm[DCFLParams, DCFLState]):
    """DCFL (Alg. 1): affinity propagation on DCFL distances, re-clustered when DI < 1."""

    name = "dcfl"
    Params = DCFLParams
    StateType = DCFLState

    def init_state(self) -> DCFLState:
        ctx = self.ctx
        assign = np.full(ctx.n_clients, -1, dtype=np.int64)
        if self.params.choice_on_device:
            k = self.params.device_clusters
            models = initial_cluster_models(ctx, k, self.name, self.params)
            directions = initial_directions(models)
            return DCFLState(models, assign, 0, directions, torch.zeros(k, dtype=torch.float64))
        empty = torch.zeros(0, ctx.dim)
        return DCFLState(ctx.init_row.unsqueeze(0).clone(), assign, 0, empty, torch.zeros(0))

    def run_round(self, state: DCFLState, rnd: int, selected: np.ndarray) -> RoundOutput[DCFLState]:
        ctx = self.ctx
        if self.params.choice_on_device:
            return self.device_round(state, rnd, selected)
        assign = state.assign.copy()
        if (assign < 0).all():
            assign[selected] = 0  # the initial clients form C_0 (Alg. 1 line 1)
        newcomers = selected[assign[selected] < 0]
        if len(newcomers):
            assign[newcomers] = self.assign_newcomer(state, newcomers, rnd)
            selected = selected[assign[selected] >= 0]  # rejected newcomers sit the round out
        state = replace(state, assign=assign)
        labels = assign[selected]
        start = state.models[labels]
        ex = ctx.exchange(selected, start, rnd)
        if not len(ex.clients):
            return RoundOutput(state, float("nan"))
        selected, start, labels = ex.clients, start[ex.keep], labels[ex.keep]

        sample = self._sample(len(selected), rnd)
        origins, ends = ctx.clustering_view(selected, start, ex.rows, self.name)
        s_start, s_rows = (origins, ends) if sample is None else (origins[sample], ends[sample])
        dist = dcfl_distance_matrix(s_start, s_rows, variant=self.params.variant)
        dunn = dunn_index(dist, labels if sample is None else labels[sample])
        previous = state.models
        reclusterings = state.reclusterings
        if len(previous) == 1 or dunn < 1.0:
            exemplars, s_labels = affinity_propagation_exemplars(
                -dist,
                preference=self.params.preference,
                damping=self.params.damping,
                random_state=int(numpy_rng(ctx.seed, "dcfl/ap", rnd).integers(2**31)),
            )
            labels = (
                s_labels
                if sample is None
                else self._nearest_exemplar(origins, ends, sample, sample[exemplars], s_labels)
            )
            assign, previous = self._recluster(state, selected, labels)
            reclusterings += 1
        models = cluster_average(ex.rows, labels, previous, aggregate=ctx.aggregate, start=start)
        new = replace(state, models=models, assign=assign, reclusterings=reclusterings)
        report = {"dunn": float(dunn), "reclusterings": float(reclusterings)}
        return RoundOutput(new, weighted_loss(ex.loss, ctx.train_sizes[selected]), report)

    def device_round(
        self, state: DCFLState, rnd: int, selected: np.ndarray
    ) -> RoundOutput[DCFLState]:
        """``choice_on_device``: eq. 6 on every selected device against the released steps,
        then each cluster's aggregate (module docstring)."""
        rule = f"dcfl-{self.params.variant}"
        done = direction_round(
            self.ctx, state.models, state.directions, state.direction_noise, rule, selected, rnd,
            self.ctx.train,
        )  # fmt: skip
        return RoundOutput(done.applied(state), done.loss)

    def _sample(self, n: int, rnd: int) -> np.ndarray | None:
        """Positions (sorted) of the round's updates the clustering runs on when there
        are more than ``max_exact_participants`` of them; None: all of them."""
        limit = self.params.max_exact_participants
        if limit is None or n <= limit:
            return None
        rng = numpy_rng(self.ctx.seed, "dcfl/sample", rnd)
        return np.sort(rng.choice(n, size=limit, replace=False))

    def _nearest_exemplar(
        self,
        origins: torch.Tensor,
        ends: torch.Tensor,
        sample: np.ndarray,
        exemplars: np.ndarray,
        sample_labels: np.ndarray,
    ) -> np.ndarray:
        """Labels [n] of all updates: the sample's from affinity propagation, every other
        one that of its nearest exemplar (``exemplars[k]``: cluster k's position among
        all) by the round's distance (eq. 2), as affinity propagation assigns the
        points it clusters."""
        labels = np.empty(len(ends), dtype=np.int64)
        labels[sample] = sample_labels
        rest = np.setdiff1d(np.arange(len(ends)), sample)
        dist = dcfl_distance_to(
            origins[rest],
            ends[rest],
            origins[exemplars],
            ends[exemplars],
            variant=self.params.variant,
        )
        labels[rest] = dist.argmin(dim=1).numpy()  # exemplars[k] is cluster k's
        return labels

    def _recluster(
        self, state: DCFLState, selected: np.ndarray, labels: np.ndarray
    ) -> tuple[np.ndarray, torch.Tensor]:
        """Every client's cluster with the participants' new ``labels``, and the models new
        clusters start from.

        Absent clients follow the majority of their old cluster's participants;
        old clusters without participants are kept, numbered after the new ones.
        """
        old = state.assign
        new = np.full_like(old, -1)
        new[selected] = labels
        n_new = int(labels.max()) + 1
        kept: list[int] = []
        absent = np.setdiff1d(np.flatnonzero(old >= 0), selected)
        for c in np.unique(old[absent]):
            moved = labels[old[selected] == c]
            if len(moved):
                target = int(np.bincount(moved).argmax())
            else:
                target = n_new + len(kept)
                kept.append(int(c))
            new[absent[old[absent] == c]] = target
        fresh = torch.zeros(n_new, self.ctx.dim)  # every new cluster has participants
        return new, torch.cat([fresh, state.models[kept]])

    def assign_newcomer(self, state: DCFLState, client: int | np.ndarray, rnd: int) -> np.ndarray:
        """Eq. 6: newcomers train once from W_G and join the cluster whose W_G → W_Ck is closest.

        ``client`` is one client id or an array of them; returns their clusters
        (−1: update rejected, the newcomer stays unassigned). Costs each newcomer
        one model down (W_G) and one update up; the cluster model follows with
        the round's broadcast.
        """
        ctx = self.ctx
        clients = np.atleast_1d(np.asarray(client, dtype=np.int64))
        models = state.models
        w_g = models.mean(dim=0)
        ex = ctx.exchange(clients, w_g, rnd, purpose="newcomer")
        placed = np.full(len(clients), -1, dtype=np.int64)
        if len(ex.clients):
            origins, ends = ctx.clustering_view(
                ex.clients, w_g.expand(len(ex.clients), -1), ex.rows, self.name
            )
            to = ctx.public_view(w_g.expand(len(models), -1), models)
            dist = dcfl_distance_to(origins, ends, *to, variant=self.params.variant)
            placed[ex.keep] = dist.argmin(dim=1).numpy()
        return placed

    def eval_rows(self, state: DCFLState) -> tuple[torch.Tensor, np.ndarray]:
        if self.ctx.secure:  # who chose which cluster stays on the devices
            return state.models, loss_choice(self.ctx, state.models, state.assign)
        return eval_rows_with_average(state.models, state.assign)

    def clusters(self, state: DCFLState) -> np.ndarray:
        return state.assign.copy()
