"""FedRC: Guo, Tang, Lin, "FedRC: Tackling Diverse Distribution Shifts Challenge in
Federated Learning by Robust Clustering", ICML 2024 (Sec. 4, the RobustCluster
objective and its federated optimisation, Alg. 1; reference code
github.com/LINs-lab/FedRC, ``client.py`` class ``FedRC`` and ``run_experiment.py``).

FedRC's clustering principle: clients whose data differ by a concept shift
(P(y|x)) go to different clusters, clients that differ only by a feature shift
(P(x)) or a label shift (P(y)) share one. It keeps FedEM's soft assignment of
every sample to K shared models (:mod:`fedcluster.algorithms.fedem`) and changes
the likelihood a model gives a sample: p(y|x; θ_k) / P̃_k(y), the model's
probability of the label divided by the share of that label in cluster k, so a
label that is rare in a cluster does not push its samples elsewhere (label shift
does not split clusters) while a sample whose label a model gets wrong still
goes to another one (concept shift does). In a round every selected client t
receives the K models θ_k and the label shares P̃ [K, C], and

1. **E-step**: the weight of model k for each training sample (x_i, y_i),
   γ_ik ∝ ω_tk · exp(−ℓ(θ_k; x_i, y_i)) / P̃_k(y_i), a softmax over k of
   log ω_tk − ℓ_ik − log P̃_k(y_i);
2. **ω-step**: ω_tk = (1/n_t) Σ_i γ_ik (the client's cluster weights, kept on the
   device);
3. **label statistics**: S_t[k, c] = Σ_{i: y_i = c} γ_ik, uploaded (K × C numbers);
4. **θ-step**: each model k trains from θ_k with the γ-weighted loss
   Σ_i γ_ik ℓ_ik / |B| per mini-batch;

the server averages each model over the round's clients weighted by their
sample counts and sets P̃_k(c) = max(Σ_t S_t[k, c], 1e-8), normalised over c,
from every client's latest statistics (the reference code's loop over all
clients; a client that has not taken part counts as uniform, 1/C per label).

As in the reference code (built on FedEM's), a client's model for testing is its
mixture Σ_k ω_tk softmax(h_θk(x)) and its cluster (``clusters.csv``) the model
of largest ω_tk; ω is in ``diagnostics.csv`` (``pi/client<t>/m<k>``). The round's
loss is −(1/n_t) Σ_i log Σ_k ω_tk e^{−ℓ_ik} / P̃_k(y_i) at the received models,
the objective the steps decrease. Plain SGD only (no momentum, μ or local DP).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np
import torch
from pydantic import Field

from fedcluster.algorithms.base import (
    Algorithm,
    AlgorithmParams,
    Context,
    RoundOutput,
    State,
    register,
    weighted_loss,
)
from fedcluster.algorithms.cluster_count import AUTO_HELP
from fedcluster.algorithms.fedem import (
    aggregate_components,
    components_shape,
    e_step,
    evaluate_mixtures,
    mixture_weights_report,
    n_components_shape,
    train_mixture,
)
from fedcluster.algorithms.mixture import check_plain_sgd
from fedcluster.engine.results import EvalResult
from fedcluster.protocol.client_side import ClientBatch, ClientContext
from fedcluster.protocol.computation import (
    ClientComputation,
    Payload,
    ReplyField,
    Request,
    register_computation,
)

log = logging.getLogger(__name__)

LABEL_FLOOR = 1e-8
"""The smallest label share P̃_k(c) (the reference code's floor before normalising)."""


def robust_e_step(
    losses: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, shares: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """FedRC's E-step and ω-step for one client: γ [n, K] ∝ ω_k e^{−ℓ_ik} / P̃_k(y_i) for
    per-sample losses ``losses`` [n, K], labels ``labels`` [n], cluster weights
    ``weights`` ω [K] and label shares ``shares`` P̃ [K, C]; and the new ω, γ's mean."""
    return e_step(robust_losses(losses, labels, shares), weights)


def robust_losses(losses: torch.Tensor, labels: torch.Tensor, shares: torch.Tensor) -> torch.Tensor:
    """ℓ_ik + log P̃_k(y_i): the negative log of FedRC's likelihood p(y|x; θ_k) / P̃_k(y)."""
    return losses.double() + torch.log(shares.double()).T[labels.long()]


def label_statistics(gamma: torch.Tensor, labels: torch.Tensor, n_classes: int) -> torch.Tensor:
    """S [K, C]: each model's summed weight γ over the client's samples of each label."""
    out = torch.zeros(gamma.shape[1], n_classes, dtype=torch.float64)
    out.index_add_(1, labels.long(), gamma.T.double())
    return out


def label_shares(statistics: torch.Tensor) -> torch.Tensor:
    """P̃ [K, C] from every client's statistics [n_clients, K, C]: their sum, floored at
    :data:`LABEL_FLOOR` and normalised over the labels."""
    total = statistics.sum(dim=0).clamp(min=LABEL_FLOOR)
    return total / total.sum(dim=1, keepdim=True)


def _shares_shape(request: Request) -> tuple[int, ...]:
    return tuple(request.shared["shares"].shape)


def _train(batch: ClientBatch, request: Request) -> Payload:
    shares = request.shared["shares"]

    def likelihood(client: ClientContext, losses: torch.Tensor) -> torch.Tensor:
        return robust_losses(losses, client.data.y_train.cpu(), shares)

    payload, gammas = train_mixture(batch, request, likelihood)
    payload["label_statistics"] = torch.stack(
        [
            label_statistics(gamma, batch.client(i).data.y_train.cpu(), shares.shape[1])
            for i, gamma in enumerate(gammas)
        ]
    ).float()
    return payload


TRAIN_ROBUST = register_computation(
    ClientComputation(
        name="fedrc-train",
        reply={
            "components": ReplyField(components_shape),
            "weights": ReplyField(n_components_shape, counted=False),
            "label_statistics": ReplyField(_shares_shape),
            "loss": ReplyField((), counted=False, finite=False),
        },
        batched_run=_train,
        exempt_because="FedRC refuses local DP (check_plain_sgd): no release of K models",
    )
)
"""FedRC's client step: the robust E-step, ω-step, label statistics and K γ-weighted local
trainings; uploads the K models and the statistics (ω stays on the device)."""


class FedRCParams(AlgorithmParams):
    n_clusters: int = Field(
        3, ge=1, description="number of cluster models K (paper: 3 concepts)" + AUTO_HELP
    )
    warn_after: int = Field(
        10, ge=0, description="rounds after which one cluster for every client is a warning"
    )


@dataclass
class FedRCState(State):
    components: torch.Tensor
    """The K cluster models [K, d]."""
    weights: torch.Tensor
    """Each client's cluster weights ω [n_clients, K] (the devices' own)."""
    statistics: torch.Tensor
    """Each client's latest label statistics S [n_clients, K, C] (uniform until it uploads)."""


@register
class FedRC(Algorithm[FedRCParams, FedRCState]):
    """FedRC (Guo et al., ICML 2024): soft clustering by FedRC's robust likelihood, which
    separates concept shifts and keeps feature and label shifts together."""

    name = "fedrc"
    Params = FedRCParams
    cluster_count = "n_clusters"
    StateType = FedRCState
    per_client_models = True

    def __init__(self, params: FedRCParams, ctx: Context) -> None:
        super().__init__(params, ctx)
        self._warned = False

    def init_state(self) -> FedRCState:
        check_plain_sgd(self.ctx, self.name)
        k, c = self.params.n_clusters, self.ctx.federation.n_classes
        return FedRCState(
            self.ctx.fresh_rows(k, "fedrc/components"),
            torch.full((self.ctx.n_clients, k), 1.0 / k, dtype=torch.float64),
            torch.full((self.ctx.n_clients, k, c), 1.0 / c, dtype=torch.float64),
        )

    def run_round(
        self, state: FedRCState, rnd: int, selected: np.ndarray
    ) -> RoundOutput[FedRCState]:
        ctx = self.ctx
        request = Request(
            shared={"components": state.components, "shares": label_shares(state.statistics)},
            own={"weights": state.weights[torch.as_tensor(selected, dtype=torch.int64)]},
            settings={"train": ctx.train, "round": rnd},
            held=frozenset({"weights"}),
        )
        replies = ctx.ask(TRAIN_ROBUST, selected, request, rnd, metadata_ints=1)
        if not len(replies.clients):
            return RoundOutput(state, float("nan"), mixture_weights_report(state.weights))
        answered = torch.as_tensor(replies.clients)
        weights, statistics = state.weights.clone(), state.statistics.clone()
        weights[answered] = replies["weights"].double()
        statistics[answered] = replies["label_statistics"].double()
        new = replace(
            state,
            components=aggregate_components(ctx, state.components, replies),
            weights=weights,
            statistics=statistics,
        )
        loss = weighted_loss(replies["loss"], ctx.train_sizes[replies.clients])
        self._warn_if_collapsed(new, rnd)
        return RoundOutput(new, loss, mixture_weights_report(weights))

    def _warn_if_collapsed(self, state: FedRCState, rnd: int) -> None:
        """Once per run: every client's largest weight on one model after ``warn_after``
        rounds (the soft assignment collapsed; more clusters than concepts, another
        seed or more rounds may separate them)."""
        used = np.unique(self.clusters(state)[self.ctx.present])
        k = self.params.n_clusters
        if k > 1 and len(used) == 1 and rnd > self.params.warn_after and not self._warned:
            self._warned = True
            log.warning(
                "fedrc round %d: every client's largest weight is on model %d of %d; the "
                "clustering has collapsed into one cluster",
                rnd,
                int(used[0]),
                k,
            )

    def evaluate(self, state: FedRCState, rnd: int) -> EvalResult:
        """Each present client's mixture Σ_k ω_k softmax(h_θk(x)) on its test data."""
        return evaluate_mixtures(self.ctx, state.components, state.weights, rnd)

    def eval_rows(self, state: FedRCState) -> tuple[torch.Tensor, np.ndarray]:
        """The cluster models and each client's model of largest ω (its cluster)."""
        return state.components, self.clusters(state)

    def clusters(self, state: FedRCState) -> np.ndarray:
        return state.weights.argmax(dim=1).numpy().astype(np.int64)
