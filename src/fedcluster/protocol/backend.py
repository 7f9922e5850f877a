"""What runs client computations, whatever they are.

:class:`Backend` is what the channel (:class:`~fedcluster.protocol.channel.Channel`)
sends requests through: the batched :class:`~fedcluster.engine.simulator.Simulator`
and the Flower backend (:class:`fedcluster.flower.flower_backend.FlowerBackend`) both
provide it. It names no computation: they are declared with their algorithms
(:mod:`fedcluster.protocol.computation`).
A backend may also provide ``run_summed`` (:func:`run_summed`): the sum of a one-field
reply over the clients, without the individual replies (Flower's secure aggregation).
The server side knows the federation through :class:`FederationView`: a full
:class:`~fedcluster.data.federation.Federation` in simulation, what the nodes
report on Flower.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
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


@dataclass
class Summed:
    """The sum of a one-field reply over the clients asked, and who is in it."""

    total: torch.Tensor
    """The sum (float64)."""
    counted: np.ndarray
    """Boolean mask over the clients asked: those whose reply is in the sum."""
    failed: dict[int, str] = field(default_factory=dict)
    """Position of each client asked that is not in the sum -> why."""


def run_summed(
    backend: Backend, computation: ClientComputation, clients: np.ndarray, request: Request
) -> Summed:
    """The sum over ``clients`` of ``computation``'s one reply field: the backend's own
    ``run_summed`` where it has one (only the sum reaches the server), else the sum of
    its replies (the simulator: the same numbers, to float rounding)."""
    (name,) = computation.reply
    own = getattr(backend, "run_summed", None)
    if own is not None:
        summed: Summed = own(computation, clients, request)
        return summed
    returned = backend.run(computation, clients, request)
    total = returned.fields[name].double().sum(dim=0)
    return Summed(total, returned.ok.copy(), {**returned.failed, **returned.malformed})
