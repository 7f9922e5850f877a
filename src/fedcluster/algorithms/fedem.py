"""FedEM: Marfoq, Neglia, Bellet, Kameni, Vidal, "Federated multi-task learning under a
mixture of distributions", NeurIPS 2021 (Alg. 1; reference code github.com/omarfoq/FedEM,
``learners/learners_ensemble.py`` and ``client.py``).

Every client's distribution is a mixture of M shared components: the server
holds M component models Θ_1..Θ_M, each client t its own mixture weights π_t
(on the device; uniform at first). In a round, every selected client receives
the M components and

1. **E-step** (eq. 8): responsibilities of each component for each of its
   training samples, q_t(z_i = m) ∝ π_tm · exp(−ℓ(h_Θm(x_i), y_i)), i.e. a
   softmax over m of log π_tm − ℓ_im (the likelihood p(y|x, Θ_m) = exp(−ℓ) of
   the cross-entropy);
2. **M-step** of the weights (eq. 9): π_tm = (1/n_t) Σ_i q_t(z_i = m);
3. **M-step** of the components (eq. 10, locally): each component trains from
   the received Θ_m with the responsibility-weighted loss
   Σ_i q_t(z_i = m) ℓ(Θ_m; x_i, y_i) / |B| per mini-batch (the local-training
   settings: epochs, batch size, learning rate);

and uploads its M components; the server averages each component over the
round's clients weighted by their sample counts (Alg. 1 line 9).

A client's model is its mixture: predictions Σ_m π_tm softmax(h_Θm(x)), and the
test loss −log of the mixture's probability of the label (the reference code's
``evaluate_iterator``); its cluster (``clusters.csv``, purity) is its
component of largest weight. The training loss of a round is the mixture's
negative log-likelihood −(1/n_t) Σ_i log Σ_m π_tm e^{−ℓ_im} at the received
components (the objective the EM steps decrease). Every client's π_t is in
``diagnostics.csv`` (``pi/client<t>/m<m>``).

Bytes: M models down and M models up per client. π_t stays on the device: the
server keeps a copy only because the simulator's clients hold no state, so it
travels uncounted in both directions. The mixture's evaluation is a measurement
like every method's test. Local DP, momentum and FedProx's μ are refused
(:func:`~fedcluster.algorithms.mixture.check_plain_sgd`); the components'
uploads have no update bound (it is defined for one model per client).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
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
from fedcluster.algorithms.mixture import (
    check_plain_sgd,
    sample_losses,
    single_threaded,
    weighted_sgd,
)
from fedcluster.engine.client_computations import EVALUATE
from fedcluster.engine.results import EvalResult
from fedcluster.protocol.channel import Replies
from fedcluster.protocol.client_side import ClientBatch, ClientContext
from fedcluster.protocol.computation import (
    ClientComputation,
    Payload,
    ReplyField,
    Request,
    register_computation,
)


def e_step(losses: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FedEM's E-step and weight M-step for one client: the responsibilities q [n, M] of
    the M components for n samples with per-sample losses ``losses`` [n, M] under the
    mixture ``weights`` π [M] (eq. 8), and the new weights (eq. 9), their mean."""
    q = torch.softmax(torch.log(weights.double()).unsqueeze(0) - losses.double(), dim=1)
    return q, q.mean(dim=0)


def mixture_nll(losses: torch.Tensor, weights: torch.Tensor) -> float:
    """−(1/n) Σ_i log Σ_m π_m e^{−ℓ_im}: the mixture's negative log-likelihood."""
    log_mix = torch.logsumexp(torch.log(weights.double()).unsqueeze(0) - losses.double(), dim=1)
    return float(-log_mix.mean()) if len(losses) else float("nan")


def n_components_shape(request: Request) -> tuple[int, ...]:
    """The reply shape of one weight per received component: (M,)."""
    return (request.shared["components"].shape[0],)


def components_shape(request: Request) -> tuple[int, ...]:
    """The reply shape of the M received components, trained: (M, d)."""
    return tuple(request.shared["components"].shape)


Likelihood = Callable[[ClientContext, torch.Tensor], torch.Tensor]
"""A client's per-sample negative log-likelihoods [n, M] from its losses [n, M]."""


def train_mixture(
    batch: ClientBatch, request: Request, likelihood: Likelihood | None = None
) -> tuple[Payload, list[torch.Tensor]]:
    """Each client's E-step, weight M-step and M responsibility-weighted local trainings
    (module docstring), the per-sample negative log-likelihoods being the losses or
    ``likelihood(client, losses)``; the reply and each client's responsibilities."""
    s = request.settings
    components = request.shared["components"]
    rows = torch.empty(len(batch), *components.shape)
    weights = torch.empty(len(batch), len(components))
    loss = torch.empty(len(batch))
    responsibilities = []
    with single_threaded():
        for i in range(len(batch)):
            client = batch.client(i)
            losses = sample_losses(client, components)
            if likelihood is not None:
                losses = likelihood(client, losses)
            pi = request.own["weights"][i]
            q, weights[i] = e_step(losses, pi)
            responsibilities.append(q)
            loss[i] = mixture_nll(losses, pi)
            for m in range(len(components)):
                rows[i, m], _ = weighted_sgd(
                    client, components[m], s["train"], s["round"], "train", sample_weight=q[:, m]
                )
    return {"components": rows, "weights": weights, "loss": loss}, responsibilities


def _train(batch: ClientBatch, request: Request) -> Payload:
    return train_mixture(batch, request)[0]


TRAIN_COMPONENTS = register_computation(
    ClientComputation(
        name="fedem-train",
        reply={
            "components": ReplyField(components_shape),
            "weights": ReplyField(n_components_shape, counted=False),
            "loss": ReplyField((), counted=False, finite=False),
        },
        batched_run=_train,
        exempt_because=(
            "FedEM refuses local DP (check_plain_sgd): no release of M components is defined"
        ),
    )
)
"""FedEM's client step: E-step, weight M-step, and the M responsibility-weighted local
trainings; uploads the M components (π stays on the device)."""


@torch.no_grad()
def _evaluate(batch: ClientBatch, request: Request) -> Payload:
    components = request.shared["components"]
    correct = torch.zeros(len(batch), dtype=torch.int64)
    count = torch.zeros(len(batch), dtype=torch.int64)
    loss_sum = torch.zeros(len(batch), dtype=torch.float64)
    with single_threaded():
        for i in range(len(batch)):
            data = batch.client(i).data
            x, y = data.x_test, data.y_test.cpu()
            prob = torch.zeros(len(y), data.n_classes, dtype=torch.float64)
            for m, pi in enumerate(request.own["weights"][i].tolist()):
                logits = batch.layout.forward(components[m].to(x.device), x)
                prob += pi * F.softmax(logits.double(), dim=1).cpu()
            correct[i] = int((prob.argmax(dim=1) == y).sum())
            count[i] = len(y)
            loss_sum[i] = float(-torch.log(prob.clamp(1e-12, 1.0)).gather(1, y[:, None]).sum())
    return {"correct": correct, "count": count, "loss_sum": loss_sum}


EVALUATE_MIXTURE = register_computation(
    ClientComputation(
        name="fedem-evaluate",
        reply=EVALUATE.reply,
        batched_run=_evaluate,
        exempt_because=EVALUATE.exempt_because,
        check=EVALUATE.check,
    )
)
"""The test accuracy and loss of each client's mixture Σ_m π_m softmax(h_Θm(x))."""


def aggregate_components(ctx: Context, components: torch.Tensor, replies: Replies) -> torch.Tensor:
    """Each of the M components averaged over the replying clients, weighted by their
    sample counts (Alg. 1 line 9), with the run's aggregation rule."""
    sizes = torch.as_tensor(ctx.train_sizes[replies.clients], dtype=torch.float32)
    uploaded = replies["components"]
    return torch.stack(
        [ctx.aggregate(components[m], uploaded[:, m], sizes) for m in range(len(uploaded[0]))]
    )


def evaluate_mixtures(
    ctx: Context, components: torch.Tensor, weights: torch.Tensor, rnd: int
) -> EvalResult:
    """Each present client's mixture Σ_m π_m softmax(h_Θm(x)) on its test data (a
    measurement), ``weights`` [n_clients, M] its π."""
    clients = np.flatnonzero(ctx.present)
    request = Request(
        shared={"components": components},
        own={"weights": weights[torch.as_tensor(clients, dtype=torch.int64)]},
        held=frozenset({"weights"}),
    )
    r = ctx.ask(EVALUATE_MIXTURE, clients, request, rnd, measurement=True)
    return EvalResult(r["correct"].numpy(), r["count"].numpy(), r["loss_sum"].numpy(), r.clients)


class FedEMParams(AlgorithmParams):
    n_components: int = Field(
        3, ge=1, description="number of shared components M (paper: 3)" + AUTO_HELP
    )


@dataclass
class FedEMState(State):
    components: torch.Tensor
    """The M component models [M, d]."""
    weights: torch.Tensor
    """Each client's mixture weights π [n_clients, M] (the devices' own; module docstring)."""


def mixture_weights_report(weights: torch.Tensor) -> dict[str, float]:
    """Every client's mixture weights π [n_clients, M]: ``pi/client<t>/m<m>``."""
    return {
        f"pi/client{t}/m{m}": float(v)
        for t, row in enumerate(weights.tolist())
        for m, v in enumerate(row)
    }


@register
class FedEM(Algorithm[FedEMParams, FedEMState]):
    """FedEM (Marfoq et al. 2021): federated EM over M shared components with per-client
    mixture weights."""

    name = "fedem"
    Params = FedEMParams
    cluster_count = "n_components"
    StateType = FedEMState
    per_client_models = True

    def init_state(self) -> FedEMState:
        check_plain_sgd(self.ctx, self.name)
        m = self.params.n_components
        return FedEMState(
            self.ctx.fresh_rows(m, "fedem/components"),
            torch.full((self.ctx.n_clients, m), 1.0 / m, dtype=torch.float64),
        )

    def run_round(
        self, state: FedEMState, rnd: int, selected: np.ndarray
    ) -> RoundOutput[FedEMState]:
        ctx = self.ctx
        request = Request(
            shared={"components": state.components},
            own={"weights": state.weights[torch.as_tensor(selected, dtype=torch.int64)]},
            settings={"train": ctx.train, "round": rnd},
            held=frozenset({"weights"}),
        )
        replies = ctx.ask(TRAIN_COMPONENTS, selected, request, rnd, metadata_ints=1)
        if not len(replies.clients):
            return RoundOutput(state, float("nan"), mixture_weights_report(state.weights))
        components = aggregate_components(ctx, state.components, replies)
        weights = state.weights.clone()
        weights[torch.as_tensor(replies.clients)] = replies["weights"].double()
        loss = weighted_loss(replies["loss"], ctx.train_sizes[replies.clients])
        new = replace(state, components=components, weights=weights)
        return RoundOutput(new, loss, mixture_weights_report(weights))

    def evaluate(self, state: FedEMState, rnd: int) -> EvalResult:
        """Each present client's mixture on its test data (a measurement)."""
        return evaluate_mixtures(self.ctx, state.components, state.weights, rnd)

    def eval_rows(self, state: FedEMState) -> tuple[torch.Tensor, np.ndarray]:
        """The components and each client's component of largest weight (its cluster);
        :meth:`evaluate` tests the mixture instead."""
        return state.components, self.clusters(state)

    def clusters(self, state: FedEMState) -> np.ndarray:
        return state.weights.argmax(dim=1).numpy().astype(np.int64)
