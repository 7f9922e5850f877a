"""FedAvg, FedProx and FedAvg+FT: the global-model baselines.

- FedAvg: McMahan et al., "Communication-efficient learning of deep networks
  from decentralized data", AISTATS 2017, Alg. 1 -- selected clients train E
  epochs of mini-batch SGD from the global model; the server averages their
  models weighted by sample count n_k / n.
- FedProx: Li et al., "Federated optimization in heterogeneous networks",
  MLSys 2020 -- the same with the proximal term (mu/2)·||w − w^t||² in the
  local objective (eq. 2 there).
- FedAvg+FT: the personalisation baseline of CFLGT (Sec. V) -- the global
  FedAvg model, fine-tuned locally on each client's classifier layer before
  evaluation ("the client will update the bottom layer of the model on its
  data"); fine-tuning is local, so it sends nothing.

Rejected updates (:meth:`~fedcluster.algorithms.base.Context.exchange`) are
left out of the average; a round without an accepted update keeps the global
model and reports a NaN loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from pydantic import Field

from fedcluster.algorithms.base import (
    Algorithm,
    AlgorithmParams,
    Exchange,
    State,
    register,
    weighted_loss,
)
from fedcluster.engine.client_computations import TRAIN
from fedcluster.engine.computation import Request
from fedcluster.engine.results import EvalResult


@dataclass
class FedAvgState(State):
    global_model: torch.Tensor
    """The global model [d]."""


class FedAvgParams(AlgorithmParams):
    mu: float = Field(0.0, ge=0.0, description="FedProx proximal coefficient (0 = FedAvg)")


@register
class FedAvg(Algorithm):
    """FedAvg (McMahan et al. 2017, Alg. 1)."""

    name = "fedavg"
    Params = FedAvgParams
    StateType = FedAvgState

    def init_state(self) -> FedAvgState:
        return FedAvgState(self.ctx.init_row.clone())

    def run_round(self, state: State, rnd: int, selected: np.ndarray) -> float:
        ex = self.step(state, rnd, selected)
        return weighted_loss(ex.loss, self.ctx.train_sizes[ex.clients])

    def step(self, state: State, rnd: int, selected: np.ndarray) -> Exchange:
        """Broadcast ``state.global_model``, train, and average the accepted models into it.

        Without an accepted update the global model stays as it was.
        """
        ctx = self.ctx
        ex = ctx.exchange(selected, state.global_model, rnd, ctx.local(mu=self.params.mu), ints=1)
        if len(ex.clients):
            sizes = torch.as_tensor(ctx.train_sizes[ex.clients])
            state.global_model = ctx.aggregate(state.global_model, ex.rows, sizes)
        return ex

    def eval_rows(self, state: State) -> tuple[torch.Tensor, np.ndarray]:
        return state.global_model.unsqueeze(0), np.zeros(self.ctx.n_clients, dtype=np.int64)


class FedProxParams(AlgorithmParams):
    mu: float = Field(0.01, gt=0.0, description="proximal coefficient mu (FedProx eq. 2)")


@register
class FedProx(FedAvg):
    """FedProx (Li et al. 2020): FedAvg with a proximal term, mu > 0."""

    name = "fedprox"
    Params = FedProxParams


class FedAvgFTParams(AlgorithmParams):
    mu: float = Field(0.0, ge=0.0)
    ft_epochs: int = Field(1, ge=1, description="local fine-tuning epochs of the classifier")
    ft_lr: float | None = Field(None, gt=0.0, description="fine-tuning rate (default: train.lr)")


@register
class FedAvgFT(FedAvg):
    """FedAvg+FT: FedAvg, then each client fine-tunes the classifier layer before evaluating."""

    name = "fedavg-ft"
    Params = FedAvgFTParams

    def evaluate(self, state: State, rnd: int) -> EvalResult:
        ctx = self.ctx
        p = self.params
        clients = np.flatnonzero(ctx.present)
        cfg = ctx.local(epochs=p.ft_epochs, steps=None, lr=p.ft_lr or ctx.train.lr, mu=0.0)
        request = Request(
            shared={"start": state.global_model},
            settings={"train": cfg, "round": rnd, "purpose": "finetune", "classifier_only": True},
        )
        tuned = ctx.ask(TRAIN, clients, request, rnd, measurement=True)
        return ctx.evaluate(tuned.clients, tuned["row"], np.arange(len(tuned.clients)), rnd)
