"""What runs client computations, whatever they are.

:class:`Backend` is what the channel (:class:`~fedcluster.protocol.channel.Channel`)
sends requests through: the batched :class:`~fedcluster.engine.simulator.Simulator`
and the Flower backend (:class:`fedcluster.flower.flower_backend.FlowerBackend`) both
provide it. It names no computation: they are declared with their algorithms
(:mod:`fedcluster.protocol.computation`).
The server side knows the federation through :class:`FederationView`: a full
:class:`~fedcluster.data.federation.Federation` in simulation, what the nodes
report on Flower.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
from torch import nn

from fedcluster.protocol.computation import ClientComputation, Request, Returned

if TYPE_CHECKING:
    from fedcluster.engine.flat import ParamLayout


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
    """Runs any registered client computation for many clients.

    The simulator runs a computation's batched form over the packed
    federation; the Flower backend sends one message per node, for the
    node's clients among those asked. ``seconds`` is the time spent in client computations.
    """

    @property
    def federation(self) -> FederationView: ...

    @property
    def layout(self) -> ParamLayout: ...

    @property
    def model(self) -> nn.Module: ...

    @property
    def seconds(self) -> float:
        """Seconds spent in client computations so far."""
        ...

    def run(
        self, computation: ClientComputation, clients: np.ndarray, request: Request
    ) -> Returned: ...
