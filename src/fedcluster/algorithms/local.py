"""Local training only: every client trains its own model and never communicates.

The lower reference of the papers' comparisons (e.g. FedGroup Sec. V, CFLGT
Table I): it measures how much collaboration helps on each client's own
distribution. Client i's model starts from the shared initial model.
"""

from __future__ import annotations

import numpy as np
import torch

from fedcluster.algorithms.base import Algorithm, State, register, weighted_loss


@register
class LocalOnly(Algorithm):
    """Local training only (no communication)."""

    name = "local"
    per_client_models = True

    def init_state(self) -> State:
        return {"rows": self.ctx.init_row.unsqueeze(0).repeat(self.ctx.n_clients, 1)}

    def run_round(self, state: State, rnd: int, selected: np.ndarray) -> float:
        result = self.ctx.sim.train(selected, state["rows"][selected], self.ctx.train, rnd)
        state["rows"][selected] = result.rows
        return weighted_loss(result.loss, self.ctx.train_sizes[selected])

    def eval_rows(self, state: State) -> tuple[torch.Tensor, np.ndarray]:
        return state["rows"], np.arange(self.ctx.n_clients)
