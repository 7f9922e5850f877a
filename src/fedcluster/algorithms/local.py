"""Local training only: every client trains its own model and never communicates.

The lower reference of the papers' comparisons (e.g. FedGroup Sec. V, CFLGT
Table I): it measures how much collaboration helps on each client's own
distribution. Client i's model starts from the shared initial model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from fedcluster.algorithms.base import (
    Algorithm,
    AlgorithmParams,
    RoundOutput,
    State,
    register,
    weighted_loss,
)
from fedcluster.engine.client_computations import TRAIN
from fedcluster.protocol.computation import Request


@dataclass
class LocalState(State):
    rows: torch.Tensor
    """Every client's own model [n, d]."""


class LocalParams(AlgorithmParams):
    """Local training has no parameters of its own (its own class names it in Python)."""


@register
class LocalOnly(Algorithm[LocalParams, LocalState]):
    """Local training only (no communication)."""

    name = "local"
    Params = LocalParams
    StateType = LocalState
    per_client_models = True

    def init_state(self) -> LocalState:
        return LocalState(self.ctx.init_row.unsqueeze(0).repeat(self.ctx.n_clients, 1))

    def run_round(
        self, state: LocalState, rnd: int, selected: np.ndarray
    ) -> RoundOutput[LocalState]:
        request = Request(
            own={"start": state.rows[selected]},
            settings={"train": self.ctx.train, "round": rnd},
        )
        # the model never leaves the client: nothing is sent, released or rejected
        trained = self.ctx.ask(TRAIN, selected, request, rnd, on_device=True)
        rows = state.rows.clone()
        rows[selected] = trained["row"]
        loss = weighted_loss(trained["loss"], self.ctx.train_sizes[selected])
        return RoundOutput(replace(state, rows=rows), loss)

    def eval_rows(self, state: LocalState) -> tuple[torch.Tensor, np.ndarray]:
        return state.rows, np.arange(self.ctx.n_clients)
