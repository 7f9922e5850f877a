"""FedSoft: Ruan, Joe-Wong, "FedSoft: soft clustered federated learning with proximal
local updating", AAAI 2022 (Alg. 1; reference code github.com/ycruan/FedSoft,
``clients.py`` and ``servers.py``).

Soft clustering: each client's data is a mixture of S cluster distributions.
The server holds S cluster models c_1..c_S; each client keeps its own local
model w_k (starting from the shared initial model). In a round, every selected
client receives the S cluster models and

1. **estimates its importance weights** (Sec. 4.1): for each of its training
   samples the cluster model of lowest loss, n_ks = the number of samples that
   cluster s fits best, u_ks = n_ks / n_k; a cluster that fits no sample gets
   the smoothed count σ·n_k (``smoother``; the reference code's
   ``count_smoother``), so u_ks > 0;
2. **trains its local model with the proximal term toward the mixture** (eq. 5):
   f_k(w) + (λ/2) Σ_s u_ks ‖w − c_s‖², from its own previous local model
   (the reference keeps each client's model across rounds). The term's
   gradient λ Σ_s u_ks (w − c_s) is FedProx's toward the mixture
   Σ_s u_ks c_s / Σ_s u_ks with μ = λ Σ_s u_ks;
3. uploads its local model and its S importance weights.

The server aggregates each cluster model weighted by the importances
(Sec. 4.2 without cluster-wise client selection, ``servers.py``):
c_s = Σ_k v_ks w_k with v_ks = u_ks n_k / Σ_k' u_k's n_k' over the round's
clients. The paper's selection of clients per cluster with probability v_ks is
replaced by the run's participation (every cluster aggregates all of the
round's clients).

A client's cluster (``clusters.csv``, purity, the model it is tested with) is
the cluster of its largest importance weight; a client that never took part
uses the average of the cluster models. Every client's importance weights are
in ``diagnostics.csv`` (``u/client<k>/c<s>``).

Bytes: the S cluster models down, the local model and S floats up per client
(the local model the server stores is the device's own: not counted down).
Local DP, momentum and FedProx's μ are refused
(:func:`~fedcluster.algorithms.mixture.check_plain_sgd`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from pydantic import Field

from fedcluster.algorithms.aggregation import eval_rows_with_average
from fedcluster.algorithms.base import (
    Algorithm,
    AlgorithmParams,
    RoundOutput,
    State,
    register,
    weighted_loss,
)
from fedcluster.algorithms.cluster_count import AUTO_HELP
from fedcluster.algorithms.mixture import (
    check_plain_sgd,
    sample_losses,
    single_threaded,
    weighted_sgd,
)
from fedcluster.engine.client_computations import n_models
from fedcluster.protocol.client_side import ClientBatch
from fedcluster.protocol.computation import (
    ClientComputation,
    Payload,
    ReplyField,
    Request,
    register_computation,
)


def importance_weights(losses: torch.Tensor, smoother: float) -> torch.Tensor:
    """FedSoft's importance estimation for one client (Sec. 4.1): the share of its
    samples (rows of ``losses`` [n, S]) that each cluster model fits best (lowest loss;
    ties to the lower index), a zero share replaced by ``smoother``: [S] (float64)."""
    n, s = losses.shape
    counts = torch.bincount(losses.argmin(dim=1), minlength=s).double()
    counts[counts == 0] = smoother * n
    return counts / max(n, 1)


def _local_dim(request: Request) -> tuple[int, ...]:
    return (request.own["start"].shape[-1],)


def _train(batch: ClientBatch, request: Request) -> Payload:
    s = request.settings
    clusters = request.shared["models"]
    rows = torch.empty(len(batch), clusters.shape[1])
    importance = torch.empty(len(batch), len(clusters))
    loss = torch.empty(len(batch))
    lam = float(s["lam"])
    with single_threaded():
        for i in range(len(batch)):
            client = batch.client(i)
            u = importance_weights(sample_losses(client, clusters), float(s["smoother"]))
            importance[i] = u
            anchor = (u.float() @ clusters) / float(u.sum())
            rows[i], loss[i] = weighted_sgd(
                client,
                request.own["start"][i],
                s["train"],
                s["round"],
                "train",
                anchor=anchor,
                mu=lam * float(u.sum()),
            )
    return {"row": rows, "importance": importance, "loss": loss}


TRAIN_SOFT = register_computation(
    ClientComputation(
        name="fedsoft-train",
        reply={
            "row": ReplyField(_local_dim),
            "importance": ReplyField(n_models),
            "loss": ReplyField((), counted=False, finite=False),
        },
        batched_run=_train,
        exempt_because=(
            "FedSoft refuses local DP (check_plain_sgd): no release of a model with its "
            "importance weights is defined"
        ),
        update=("row", "start"),
    )
)
"""FedSoft's client step: importance estimation under the S received cluster models,
then proximal local training of the client's own model; uploads both."""


class FedSoftParams(AlgorithmParams):
    n_clusters: int = Field(4, ge=1, description="number of cluster models S" + AUTO_HELP)
    lam: float = Field(
        0.1, ge=0.0, description="λ: weight of the proximal term toward the cluster models"
    )
    smoother: float = Field(
        1e-4, gt=0.0, lt=1.0, description="σ: the share given to a cluster that fits no sample"
    )


@dataclass
class FedSoftState(State):
    models: torch.Tensor
    """The S cluster models [S, d]."""
    local: torch.Tensor
    """Each client's own local model [n_clients, d] (the devices'; module docstring)."""
    importance: torch.Tensor
    """Each client's importance weights u [n_clients, S] (NaN: never estimated)."""


def importance_report(importance: torch.Tensor) -> dict[str, float]:
    """Every client's importance weights u [n_clients, S] once estimated: ``u/client<k>/c<s>``."""
    return {
        f"u/client{k}/c{s}": v
        for k, row in enumerate(importance.tolist())
        for s, v in enumerate(row)
        if not np.isnan(v)
    }


@register
class FedSoft(Algorithm[FedSoftParams, FedSoftState]):
    """FedSoft (Ruan & Joe-Wong 2022): soft clustering by importance weights, proximal
    local updates toward the mixture of cluster models."""

    name = "fedsoft"
    Params = FedSoftParams
    cluster_count = "n_clusters"
    StateType = FedSoftState

    def init_state(self) -> FedSoftState:
        check_plain_sgd(self.ctx, self.name)
        ctx = self.ctx
        s = self.params.n_clusters
        return FedSoftState(
            ctx.fresh_rows(s, "fedsoft/clusters"),
            ctx.init_row.unsqueeze(0).repeat(ctx.n_clients, 1),
            torch.full((ctx.n_clients, s), float("nan"), dtype=torch.float64),
        )

    def run_round(
        self, state: FedSoftState, rnd: int, selected: np.ndarray
    ) -> RoundOutput[FedSoftState]:
        ctx = self.ctx
        p = self.params
        request = Request(
            shared={"models": state.models},
            own={"start": state.local[torch.as_tensor(selected, dtype=torch.int64)]},
            settings={
                "train": ctx.train,
                "round": rnd,
                "lam": p.lam,
                "smoother": p.smoother,
            },
            held=frozenset({"start"}),
        )
        replies = ctx.ask(TRAIN_SOFT, selected, request, rnd, metadata_ints=1)
        clients = replies.clients
        if not len(clients):
            return RoundOutput(state, float("nan"), importance_report(state.importance))
        rows, u = replies["row"], replies["importance"].double()
        sizes = torch.as_tensor(ctx.train_sizes[clients], dtype=torch.float64)
        models = torch.stack(
            [
                ctx.aggregate(state.models[k], rows, (u[:, k] * sizes).float())
                for k in range(p.n_clusters)
            ]
        )
        index = torch.as_tensor(clients)
        local, importance = state.local.clone(), state.importance.clone()
        local[index] = rows
        importance[index] = u
        new = replace(state, models=models, local=local, importance=importance)
        loss = weighted_loss(replies["loss"], ctx.train_sizes[clients])
        return RoundOutput(new, loss, importance_report(importance))

    def eval_rows(self, state: FedSoftState) -> tuple[torch.Tensor, np.ndarray]:
        return eval_rows_with_average(state.models, self.clusters(state))

    def clusters(self, state: FedSoftState) -> np.ndarray:
        u = state.importance
        known = ~torch.isnan(u).any(dim=1)
        out = torch.full((len(u),), -1, dtype=torch.int64)
        out[known] = u[known].argmax(dim=1)
        return out.numpy()
