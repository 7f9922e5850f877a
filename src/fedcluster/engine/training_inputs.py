"""What every training strategy of the simulator reads.

The simulator (:mod:`fedcluster.engine.simulator`) is the backend: it holds the
packed federation, draws each client's batch plan and dispatches local training
to one of its strategies (:mod:`fedcluster.engine.autograd_training` for any
model, :mod:`fedcluster.engine.kernel_training` for MLPs, with the DP-SGD steps of
:mod:`fedcluster.engine.dp_training`). The strategies share this read-only view
of the run: the data, the model's flat layout, the loss and each client's
identity in the random streams.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedcluster.data.federation import Federation
from fedcluster.engine.flat import ParamLayout
from fedcluster.engine.modes import LossFn
from fedcluster.rng import torch_rng


@dataclass(frozen=True)
class TrainingInputs:
    """The packed federation (``x_flat``: its training inputs as rows [N, f], a view),
    the model's flat layout and loss, the run's seed, each client's id in the random
    streams (``client_ids[i]`` names client i) and the worker threads (``None``: as
    many as the load allows)."""

    federation: Federation
    x_flat: torch.Tensor
    layout: ParamLayout
    loss: LossFn
    seed: int
    client_ids: np.ndarray
    threads: int | None

    @property
    def device(self) -> torch.device:
        """The device the federation's tensors live on."""
        return self.federation.x_train.device

    def dropout_generator(
        self, clients: np.ndarray, rnd: int, purpose: str, i: int
    ) -> torch.Generator:
        """The generator of client ``clients[i]``'s training randomness (Dropout's masks),
        derived from ``(seed, "dropout/<purpose>", round, client)``."""
        return torch_rng(self.seed, f"dropout/{purpose}", rnd, int(self.client_ids[clients[i]]))
