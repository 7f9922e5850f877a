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

from dataclasses import dataclass, replace

import numpy as np
import torch
from pydantic import Field

from fedcluster.algorithms.base import (
    Algorithm,
    AlgorithmParams,
    Context,
    Exchange,
    RoundOutput,
    State,
    register,
    weighted_loss,
)
from fedcluster.engine.client_computations import TRAIN
from fedcluster.engine.results import EvalResult
from fedcluster.protocol.batches import LocalTraining
from fedcluster.protocol.computation import Request


@dataclass
class FedAvgState(State):
    global_model: torch.Tensor
    """The global model [d]."""


class FedAvgParams(AlgorithmParams):
    mu: float = Field(0.0, ge=0.0, description="FedProx proximal coefficient (0 = FedAvg)")


def fedavg_step(
    ctx: Context,
    global_model: torch.Tensor,
    rnd: int,
    selected: np.ndarray,
    cfg: LocalTraining | None = None,
) -> tuple[torch.Tensor, Exchange]:
    """One FedAvg round (McMahan et al. 2017, Alg. 1): broadcast ``global_model`` [d],
    the ``selected`` clients train (``cfg``: the local training, default the run's),
    and the accepted models are aggregated weighted by sample count n_k / n.

    Returns the new global model (``global_model`` itself when no update was
    accepted; it is never modified) and the exchange (accepted clients and losses).
    """
    ex = ctx.exchange(selected, global_model, rnd, cfg, ints=1)
    if not len(ex.clients):
        return global_model, ex
    sizes = torch.as_tensor(ctx.train_sizes[ex.clients])
    return ctx.aggregate(global_model, ex.rows, sizes), ex


@register
class FedAvg(Algorithm[FedAvgParams, FedAvgState]):
    """FedAvg (McMahan et al. 2017, Alg. 1)."""

    name = "fedavg"
    Params = FedAvgParams
    StateType = FedAvgState

    def init_state(self) -> FedAvgState:
        return FedAvgState(self.ctx.init_row.clone())

    def run_round(
        self, state: FedAvgState, rnd: int, selected: np.ndarray
    ) -> RoundOutput[FedAvgState]:
        ctx = self.ctx
        if ctx.secure:
            return self.secure_round(state, rnd, selected)
        model, ex = fedavg_step(
            ctx, state.global_model, rnd, selected, ctx.local(mu=self.params.mu)
        )
        loss = weighted_loss(ex.loss, ctx.train_sizes[ex.clients])
        return RoundOutput(replace(state, global_model=model), loss)

    def secure_round(
        self, state: FedAvgState, rnd: int, selected: np.ndarray
    ) -> RoundOutput[FedAvgState]:
        """DP-FedAvg under secure aggregation (:mod:`fedcluster.protocol.secure_sum`): the
        server receives the sum of the clipped updates and their count, and releases the
        trusted server's model from them (the same noise)."""
        ctx = self.ctx
        request = ctx.training_request(state.global_model, rnd, ctx.local(mu=self.params.mu))
        models, total = ctx.secure_total(TRAIN, selected, request, rnd)
        return RoundOutput(replace(state, global_model=models[0]), total.mean_loss)

    def eval_rows(self, state: FedAvgState) -> tuple[torch.Tensor, np.ndarray]:
        return state.global_model.unsqueeze(0), np.zeros(self.ctx.n_clients, dtype=np.int64)


class FedProxParams(FedAvgParams):
    mu: float = Field(0.01, gt=0.0, description="proximal coefficient mu (FedProx eq. 2)")


@register
class FedProx(FedAvg):
    """FedProx (Li et al. 2020): FedAvg with a proximal term, mu > 0."""

    name = "fedprox"
    Params = FedProxParams


class FedAvgFTParams(FedAvgParams):
    mu: float = Field(0.0, ge=0.0)
    ft_epochs: int = Field(1, ge=1, description="local fine-tuning epochs of the classifier")
    ft_lr: float | None = Field(None, gt=0.0, description="fine-tuning rate (default: train.lr)")


@register
class FedAvgFT(FedAvg):
    """FedAvg+FT: FedAvg, then each client fine-tunes the classifier layer before evaluating."""

    name = "fedavg-ft"
    Params: type[FedAvgFTParams] = FedAvgFTParams
    params: FedAvgFTParams

    def evaluate(self, state: FedAvgState, rnd: int) -> EvalResult:
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
