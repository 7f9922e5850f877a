"""JGL's choices against IFCA's (λ = 0): the differs_from_loss_choice diagnostic."""

from __future__ import annotations

import numpy as np
import torch

from fedcluster.algorithms.jgl import JGL, jgl_scores, loss_choice_differences
from fedcluster.protocol.batches import LocalTraining
from tests.helpers import make_context, rotated_digits


def test_loss_choice_differences_by_hand():
    loss = torch.tensor([[1.0, 2.0], [3.0, 0.5], [0.2, 0.1]])
    assert loss_choice_differences(np.array([0, 1, 1]), loss) == 0
    assert loss_choice_differences(np.array([1, 1, 0]), loss) == 2


def test_lambda_zero_never_differs_and_a_decisive_similarity_does():
    loss = torch.tensor([[1.0, 1.01]])
    grad_sq, grad_dot, delta_sq = torch.ones(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(2)
    # cluster 1 moved along this client's descent direction (−∇L·Δw > 0): the similarity prefers it
    scores = jgl_scores(loss, grad_sq, grad_dot, delta_sq, lam=0.5)
    assert loss_choice_differences(scores.argmax(dim=1).numpy(), loss) == 1
    scores = jgl_scores(loss, grad_sq, grad_dot, delta_sq, lam=0.0)
    assert loss_choice_differences(scores.argmax(dim=1).numpy(), loss) == 0


def test_diagnostic_is_logged_each_round():
    fed = rotated_digits(n_groups=2, clients_per_group=2, per_client=40)
    counts = {}
    for lam, reduction in ((0.0, "sum"), (0.99, "mean")):
        ctx = make_context(fed, hidden=[8], train=LocalTraining(lr=0.1, batch_size=16, steps=1))
        alg = JGL(JGL.Params(n_clusters=2, lam=lam, loss_reduction=reduction), ctx)
        state = alg.init_state()
        seen = []
        for rnd in range(1, 5):
            out = alg.run_round(state, rnd, np.arange(fed.n_clients))
            state = out.state
            seen.append(out.diagnostics["differs_from_loss_choice"])
        counts[lam] = seen
    assert counts[0.0] == [0.0] * 4  # λ = 0 is IFCA
    assert all(0 <= c <= fed.n_clients for c in counts[0.99])
