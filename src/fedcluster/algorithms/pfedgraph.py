"""pFedGraph: Ye, Ni, Wu, Chen, Wang, "Personalized Federated Learning with Inferred
Collaboration Graphs", ICML 2023 (PMLR 202); reference code
github.com/MediaBrain-SJTU/pFedGraph, ``pytorch/pfedgraph_cosine.py`` and
``pytorch/pfedgraph_cosine/utils.py`` (``cal_model_cosine_difference``,
``optimizing_graph_matrix_neighbor``, ``aggregation_by_graph``). The paper's text
could not be read here; the steps follow the reference code (section and equation
numbers are not given because we could not check them).

Every client keeps a personalised model; the server keeps a collaboration graph A
(row i: the weights client i gives the others; initially 1/(N − 1) off the diagonal).
Each round the selected clients train their personalised model and upload it; then:

1. **model differences**: d_ij = −cos(θ_i − θ_0, θ_j − θ_0) between the
   participants' models relative to the initial model θ_0 (the reference code's
   ``dw``), set to −1 below −0.9 (the code's rule; so d_ii = −1);
2. **graph inference**: each participant's row over the participants solves
   min_a α‖a‖² + (d_i − 2α p)ᵀ a on the simplex (a ≥ 0, Σ a = 1), p the participants'
   sample shares: close to the data-size weights, moved towards similar models,
   with α against concentrating on a few. The objective is α‖a − (p − d_i/(2α))‖² up to
   a constant, so the row is the Euclidean projection of p − d_i/(2α) onto the
   simplex (:func:`project_to_simplex`, Duchi et al., ICML 2008, Fig. 1; the code
   solves the same problem with cvxpy);
3. **aggregation**: each participant's personalised model becomes
   θ_i ← Σ_j a_ij θ_j over the participants (:func:`graph_rows`), through the run's
   aggregation rule (``aggregation:``, docs/reliability.md) with the weights a_ij:
   the weighted mean by default, a robust rule's weighted form otherwise.

Clients not selected keep their model and their row of A. The reference code also
adds λ·⟨c_i, θ⟩/‖θ‖ to the local loss, c_i = Σ_j a_ij θ_j/‖θ_j‖ (``lam`` = 0.01);
that term needs a training objective the client computations do not offer, so it
is not implemented: the local training is the run's plain one (λ = 0).

pFedGraph is not a clustering method: ``clusters`` is None. The graph is saved with
the run (``artifacts``: ``graph``). Diagnostics: ``pfedgraph/self_weight`` (mean
a_ii of the round's participants) and ``pfedgraph/entropy`` (mean entropy of their
rows, in nats). Rows that put almost all weight on the client itself (mean
a_ii above ``warn_self_weight``) mean the graph isolates the clients -- each learns
alone -- and are logged once as a warning.
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
    RoundOutput,
    State,
    log,
    register,
    weighted_loss,
)
from fedcluster.clustering.distances import cosine_similarity_matrix

CLOSE = -0.9
"""Model differences below this count as −1 (reference code)."""


class PFedGraphParams(AlgorithmParams):
    alpha: float = Field(
        0.8, gt=0.0, description="α: weight of ‖a‖² against concentrated rows (reference: 0.8)"
    )
    warn_self_weight: float = Field(
        0.9, gt=0.0, le=1.0, description="warn when the rows' mean self-weight exceeds this"
    )


def project_to_simplex(v: np.ndarray) -> np.ndarray:
    """The Euclidean projection of ``v`` [n] onto {a ≥ 0, Σ a = 1} (Duchi et al. 2008)."""
    u = np.sort(v)[::-1]
    cumulative = np.cumsum(u) - 1.0
    index = np.arange(1, len(v) + 1)
    rho = int(np.flatnonzero(u - cumulative / index > 0)[-1])
    theta = cumulative[rho] / (rho + 1)
    return np.maximum(v - theta, 0.0)


def model_differences(updates: torch.Tensor) -> np.ndarray:
    """d_ij = −cos(u_i, u_j) of the updates ``updates`` [n, d], −1 where below −0.9."""
    d = -cosine_similarity_matrix(updates).numpy()
    return np.where(d < CLOSE, -1.0, d)


def graph_rows(differences: np.ndarray, shares: np.ndarray, alpha: float) -> np.ndarray:
    """Each row a_i [n, n] of the collaboration graph: the simplex minimiser of
    α‖a‖² + (d_i − 2α p)ᵀ a (module docstring, step 2)."""
    return np.stack([project_to_simplex(shares - d / (2.0 * alpha)) for d in differences])


@dataclass
class PFedGraphState(State):
    models: torch.Tensor
    """Each client's personalised model [N, d]."""
    graph: np.ndarray
    """The collaboration graph A [N, N] (row i: client i's weights)."""


@register
class PFedGraph(Algorithm[PFedGraphParams, PFedGraphState]):
    """pFedGraph: personalised models aggregated along an inferred collaboration graph."""

    name = "pfedgraph"
    Params = PFedGraphParams
    StateType = PFedGraphState

    def __init__(self, params: PFedGraphParams, ctx: Context) -> None:
        super().__init__(params, ctx)
        self._warned = False

    def init_state(self) -> PFedGraphState:
        n = self.ctx.n_clients
        graph = np.full((n, n), 1.0 / max(n - 1, 1))
        np.fill_diagonal(graph, 0.0)
        return PFedGraphState(self.ctx.init_row.unsqueeze(0).repeat(n, 1), graph)

    def run_round(
        self, state: PFedGraphState, rnd: int, selected: np.ndarray
    ) -> RoundOutput[PFedGraphState]:
        ctx = self.ctx
        ex = ctx.exchange(selected, state.models[selected], rnd, ints=1)  # and the sample count
        if not len(ex.clients):
            return RoundOutput(state, float("nan"))
        sizes = ctx.train_sizes[ex.clients]
        differences = model_differences(ctx.compared(ex.rows - ctx.init_row.unsqueeze(0)))
        rows = graph_rows(differences, sizes / sizes.sum(), self.params.alpha)
        graph = state.graph.copy()
        graph[np.ix_(ex.clients, ex.clients)] = rows
        models = state.models.clone()
        starts = state.models[ex.clients]
        for i, row in enumerate(rows):
            near = np.flatnonzero(row > 0.0)
            weights = torch.as_tensor(row[near])
            models[ex.clients[i]] = ctx.aggregate(starts[i], ex.rows[near], weights)
        report = self.report(rows, rnd)
        new = replace(state, models=models, graph=graph)
        return RoundOutput(new, weighted_loss(ex.loss, sizes), report)

    def report(self, rows: np.ndarray, rnd: int) -> dict[str, float]:
        """The round's diagnostics (module docstring), warning once on isolated clients."""
        self_weight = float(np.diag(rows).mean())
        positive = np.where(rows > 0, rows, 1.0)
        entropy = float(-(rows * np.log(positive)).sum(axis=1).mean())
        if self_weight > self.params.warn_self_weight and len(rows) > 1 and not self._warned:
            self._warned = True
            log.warning(
                "pfedgraph round %d: the collaboration graph isolates the clients (mean "
                "self-weight %.3f): each client learns alone; a larger alpha spreads the rows",
                rnd,
                self_weight,
            )
        return {"pfedgraph/self_weight": self_weight, "pfedgraph/entropy": entropy}

    def eval_rows(self, state: PFedGraphState) -> tuple[torch.Tensor, np.ndarray]:
        return state.models, np.arange(self.ctx.n_clients)

    def artifacts(self, state: PFedGraphState) -> dict[str, np.ndarray]:
        return {"graph": state.graph.copy()}
