"""The client computations an algorithm may ask for, whatever runs them (DESIGN principle 1).

:class:`Backend` is what :class:`~fedcluster.algorithms.base.Context` holds:
the batched :class:`~fedcluster.engine.simulator.Simulator` and the Flower
backend (:class:`fedcluster.flower.backend.FlowerBackend`) both provide it.
The server side knows the federation through :class:`FederationView`: a full
:class:`~fedcluster.data.federation.Federation` in simulation, what the nodes
report on Flower.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import nn

from fedcluster.engine.batches import LocalTraining
from fedcluster.engine.flat import ParamLayout
from fedcluster.engine.results import EvalResult, TrainResult

if TYPE_CHECKING:
    from fedcluster.privacy import LocalDP


class FederationView(Protocol):
    """What the server may know of the federation: sizes, ground truth, data shape."""

    @property
    def n_clients(self) -> int: ...

    @property
    def train_sizes(self) -> np.ndarray: ...

    @property
    def groups(self) -> np.ndarray | None: ...

    @property
    def n_classes(self) -> int: ...

    @property
    def input_shape(self) -> tuple[int, ...]: ...


class Backend(Protocol):
    """Client computations for many clients; ``seconds`` is the time spent in them."""

    federation: FederationView
    layout: ParamLayout
    model: nn.Module
    seconds: float

    def timed(self) -> AbstractContextManager[None]: ...

    def train(
        self,
        clients: np.ndarray,
        start: torch.Tensor,
        cfg: LocalTraining,
        rnd: int,
        purpose: str = "train",
        classifier_only: bool = False,
        privacy: LocalDP | None = None,
    ) -> TrainResult: ...

    def losses_and_grads(
        self,
        clients: np.ndarray,
        models: torch.Tensor,
        cfg: LocalTraining,
        rnd: int,
        purpose: str = "decide",
        with_grads: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def losses_and_gradient_products(
        self,
        clients: np.ndarray,
        models: torch.Tensor,
        directions: torch.Tensor,
        cfg: LocalTraining,
        rnd: int,
        purpose: str = "decide",
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def gradient_trajectories(
        self, clients: np.ndarray, row: torch.Tensor, normalise: bool = True
    ) -> torch.Tensor: ...

    def evaluate(
        self,
        clients: np.ndarray,
        rows: torch.Tensor,
        model_of_client: np.ndarray,
        split: str = "test",
    ) -> EvalResult: ...
