"""Which model a client is tested with: the one it is assigned, or IFCA's own-loss choice.

IFCA (Ghosh et al., NeurIPS 2020, Sec. 5 and its reference code
``mnist/train_cluster_mnist.py``, ``get_inference_stats``): a test client
evaluates every cluster model on its own test data and is scored with the model
of lowest loss (the cluster identity estimate of Alg. 1 applied at test time).
``model_choice: own_loss`` in the ``evaluation`` config section selects this
protocol; ``assigned`` (the default) tests each client with the model its
algorithm gives it. Algorithms whose clients hold models of their own
(``Algorithm.per_client_models``, e.g. local training) keep them under
either protocol.
"""

from __future__ import annotations

import numpy as np
import torch

from fedcluster.engine.backend import Backend
from fedcluster.engine.results import EvalResult

MODEL_CHOICES = ("assigned", "own_loss")


def per_model_results(
    sim: Backend, clients: np.ndarray, rows: torch.Tensor, split: str = "test"
) -> list[EvalResult]:
    """Loss and accuracy of every model ``rows[j]`` on every client's ``split`` data."""
    n = len(clients)
    return [sim.evaluate(clients, rows, np.full(n, j), split=split) for j in range(rows.shape[0])]


def mean_losses(results: list[EvalResult]) -> torch.Tensor:
    """Mean loss [n, K] of each client under each of the K models of ``results``."""
    return torch.as_tensor(np.stack([r.loss_sum / np.maximum(r.count, 1) for r in results], axis=1))


def own_loss_evaluate(
    sim: Backend, clients: np.ndarray, rows: torch.Tensor
) -> tuple[EvalResult, np.ndarray]:
    """Each client tested with the model of lowest loss on its own test data.

    Returns the result and the chosen model per client (ties: the lowest index,
    as ``np.argmin`` in IFCA's reference code).
    """
    results = per_model_results(sim, clients, rows, "test")
    choice = mean_losses(results).numpy().argmin(axis=1)
    pick = np.arange(len(clients))
    correct = np.stack([r.correct for r in results], axis=1)[pick, choice]
    loss_sum = np.stack([r.loss_sum for r in results], axis=1)[pick, choice]
    return EvalResult(correct, results[0].count.copy(), loss_sum), choice
