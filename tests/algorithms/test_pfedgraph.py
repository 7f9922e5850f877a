"""pFedGraph (Ye et al., ICML 2023): the graph inference against a general-purpose
solver of its quadratic program, the aggregation against its formula, and the graph
of a small federation with rotation groups."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from fedcluster.algorithms.pfedgraph import (
    PFedGraph,
    graph_rows,
    model_differences,
    project_to_simplex,
)
from tests.helpers import FLOAT_BYTES, INT_BYTES, make_context, rotated_digits

SMALL_MLP = {"hidden": [32]}


@pytest.fixture(scope="module")
def rotations():
    return rotated_digits(n_groups=4, clients_per_group=4, per_client=80)


def slsqp_row(d: np.ndarray, p: np.ndarray, alpha: float) -> np.ndarray:
    """min α‖a‖² + (d − 2αp)ᵀa on the simplex, by scipy's SLSQP (the code's cvxpy QP)."""
    q = d - 2 * alpha * p
    n = len(d)
    result = minimize(
        lambda a: alpha * a @ a + q @ a,
        np.full(n, 1.0 / n),
        jac=lambda a: 2 * alpha * a + q,
        bounds=[(0.0, None)] * n,
        constraints=[{"type": "eq", "fun": lambda a: a.sum() - 1.0}],
        method="SLSQP",
        options={"ftol": 1e-14, "maxiter": 500},
    )
    assert result.success
    return result.x


@pytest.mark.parametrize("alpha", [0.05, 0.8, 5.0])
def test_graph_rows_solve_the_quadratic_program(alpha):
    rng = np.random.default_rng(3)
    updates = torch.as_tensor(rng.normal(size=(6, 20)))
    updates[1] = updates[0] * 2.0 + 0.01 * updates[1]  # a near-duplicate direction
    d = model_differences(updates)
    u = updates.numpy()
    norms = np.linalg.norm(u, axis=1)
    cos = u @ u.T / np.outer(norms, norms)
    assert np.allclose(d, np.where(-cos < -0.9, -1.0, -cos), atol=1e-12)
    assert np.allclose(np.diag(d), -1.0) and d[0, 1] == -1.0
    p = rng.random(6)
    p /= p.sum()
    rows = graph_rows(d, p, alpha)
    for i in range(6):
        assert rows[i].min() >= 0.0 and np.isclose(rows[i].sum(), 1.0, atol=1e-12)
        # SLSQP stops within about sqrt(ftol) of the optimum
        assert np.allclose(rows[i], slsqp_row(d[i], p, alpha), atol=1e-5)


def test_projection_to_the_simplex_on_hand_made_points():
    assert np.allclose(project_to_simplex(np.array([0.2, 0.3, 0.5])), [0.2, 0.3, 0.5])
    assert np.allclose(project_to_simplex(np.array([2.0, 0.0, 0.0])), [1.0, 0.0, 0.0])
    assert np.allclose(project_to_simplex(np.array([1.0, 1.0, -1.0])), [0.5, 0.5, 0.0])


def test_pfedgraph_round_aggregates_along_the_graph(rotations):
    """Selected clients: θ_i ← Σ_j a_ij θ_j over the round's uploads, their rows of A
    replaced; the others keep their model and row. Bytes: each model down, model and
    sample count up."""
    ctx = make_context(rotations, **SMALL_MLP)
    alg = PFedGraph(PFedGraph.Params(), ctx)
    state = alg.init_state()
    selected = np.array([0, 1, 4, 5, 9, 13])
    ctx.channel.start_round()
    probe = ctx.exchange(selected, state.models[selected], 1)  # the same draws as the round
    ctx.channel.start_round()
    new = alg.run_round(state, 1, selected).state
    sizes = ctx.train_sizes[selected]
    rows = graph_rows(
        model_differences(probe.rows - ctx.init_row), sizes / sizes.sum(), alg.params.alpha
    )
    assert np.allclose(new.graph[np.ix_(selected, selected)], rows)
    expected = torch.as_tensor(rows).mm(probe.rows.double())
    assert torch.allclose(new.models[selected].double(), expected, atol=1e-6)
    others = np.setdiff1d(np.arange(16), selected)
    assert torch.equal(new.models[others], state.models[others])
    assert np.array_equal(new.graph[others], state.graph[others])
    assert ctx.channel.traffic.up == 6 * (ctx.dim * FLOAT_BYTES + INT_BYTES)
    assert ctx.channel.traffic.down == 6 * ctx.dim * FLOAT_BYTES


def test_pfedgraph_graph_connects_the_rotation_groups(rotations):
    """From round 3 on (seed 0) every client gives all its weight to its own rotation
    group, by round 4 equally to the 4 members; the graph is saved with the run."""
    ctx = make_context(rotations, **SMALL_MLP)
    alg = PFedGraph(PFedGraph.Params(), ctx)
    state = alg.init_state()
    for rnd in (1, 2, 3, 4):
        ctx.channel.start_round()
        out = alg.run_round(state, rnd, np.arange(16))
        state = out.state
    same = rotations.groups[:, None] == rotations.groups[None, :]
    assert np.allclose((state.graph * same).sum(axis=1), 1.0)
    assert alg.clusters(state) is None
    assert np.array_equal(alg.artifacts(state)["graph"], state.graph)
    assert out.diagnostics["pfedgraph/self_weight"] == pytest.approx(0.25)


def test_pfedgraph_warns_once_when_the_graph_isolates_the_clients(rotations, caplog):
    """A tiny α lets d_ii = −1 win: every row puts all weight on the client itself."""
    ctx = make_context(rotations, **SMALL_MLP)
    alg = PFedGraph(PFedGraph.Params(alpha=0.01), ctx)
    state = alg.init_state()
    with caplog.at_level(logging.WARNING, logger="fedcluster"):
        for rnd in (1, 2):
            ctx.channel.start_round()
            out = alg.run_round(state, rnd, np.arange(16))
            state = out.state
    assert out.diagnostics["pfedgraph/self_weight"] == 1.0
    assert np.allclose(np.diag(state.graph), 1.0)
    assert len([r for r in caplog.records if "isolates the clients" in r.message]) == 1
