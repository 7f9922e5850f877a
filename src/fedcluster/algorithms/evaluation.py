"""Which model a client is tested with: the one it is assigned, or IFCA's own-loss choice.

IFCA (Ghosh et al., NeurIPS 2020, Sec. 5 and its reference code
``mnist/train_cluster_mnist.py``, ``get_inference_stats``): a test client
evaluates every cluster model on its own test data and is scored with the model
of lowest loss (the cluster identity estimate of Alg. 1 applied at test time).
``model_choice: own_loss`` in the ``evaluation`` config section selects this
protocol; ``assigned`` (the default) tests each client with the model its
algorithm gives it. Algorithms whose clients hold models of their own
(``Algorithm.per_client_models``, e.g. local training) keep them under
either protocol. Every evaluation goes through the channel as a measurement.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from fedcluster.engine.client_computations import EVALUATE_MODELS
from fedcluster.engine.results import EvalResult
from fedcluster.protocol.computation import Request

if TYPE_CHECKING:
    from fedcluster.algorithms.base import Context

MODEL_CHOICES = ("assigned", "own_loss")


def own_loss_evaluate(
    ctx: Context, clients: np.ndarray, rows: torch.Tensor, rnd: int
) -> tuple[EvalResult, np.ndarray]:
    """Each client tested with the model of lowest loss on its own test data.

    One measurement asks every client for all K models' results
    (:data:`~fedcluster.engine.client_computations.EVALUATE_MODELS`: one pass
    over each distinct test set). Returns the result and the chosen model per
    client (ties: the lowest index, as ``np.argmin`` in IFCA's reference code).
    """
    request = Request(shared={"models": rows}, settings={"split": "test"})
    replies = ctx.ask(EVALUATE_MODELS, clients, request, rnd, measurement=True)
    correct, count = replies["correct"].numpy(), replies["count"].numpy()
    loss_sums = replies["loss_sum"].numpy()
    choice = (loss_sums / np.maximum(count, 1)[:, None]).argmin(axis=1)
    pick = np.arange(len(choice))
    result = EvalResult(correct[pick, choice], count, loss_sums[pick, choice], replies.clients)
    return result, choice
