"""The algorithm interface shared by every method and both backends.

Modelled on FedJAX's ``FederatedAlgorithm`` (``init`` + ``apply`` over a small
server state) and pfl-research's split between what the server asks of
clients and what they compute (DESIGN principle 1):

- an algorithm is *server logic*: who gets which model, clustering,
  aggregation -- the methods of :class:`Algorithm`;
- what a client computes is a named client computation of the backend
  (:class:`~fedcluster.engine.simulator.Simulator`: ``train``,
  ``losses_and_grads``, ``evaluate``, ...), run for many clients at once in
  simulation and for one client on a real Flower node;
- every payload is counted in :class:`Comm` where it is sent, so
  ``bytes_up`` / ``bytes_down`` are exact and privacy can be reasoned about.

Server state is a plain ``dict`` of tensors, arrays and numbers, so a
checkpoint is ``torch.save(state)`` and a resumed run continues exactly.
"""

from __future__ import annotations

import copy
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from fedcluster.engine.batches import LocalTraining
from fedcluster.engine.simulator import EvalResult, Simulator

State = dict[str, Any]

FLOAT_BYTES = 4  # parameters travel as float32
INT_BYTES = 4  # sample counts and cluster ids travel as int32

log = logging.getLogger("fedcluster")


class AlgorithmParams(BaseModel):
    """Hyperparameters of an algorithm; unknown keys are an error naming the key."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class Comm:
    """Bytes sent by the server (down) and by clients (up) in the current round."""

    up: int = 0
    down: int = 0

    def broadcast(self, n_clients: int, floats: int = 0, ints: int = 0) -> None:
        """The server sends each of ``n_clients`` clients ``floats`` float32 and ``ints`` int32."""
        self.down += int(n_clients) * (FLOAT_BYTES * int(floats) + INT_BYTES * int(ints))

    def upload(self, n_clients: int, floats: int = 0, ints: int = 0) -> None:
        """Each of ``n_clients`` clients sends ``floats`` float32 and ``ints`` int32."""
        self.up += int(n_clients) * (FLOAT_BYTES * int(floats) + INT_BYTES * int(ints))


UploadTransform = Callable[[np.ndarray, torch.Tensor, torch.Tensor, int], torch.Tensor]
"""What a client does to its model between local training and upload, in
:meth:`Context.exchange`: ``(clients, start_rows, trained_rows, round) -> rows``
(e.g. clipping and noising the update for local differential privacy, or a
simulated faulty client)."""


@dataclass
class Exchange:
    """What came back from a round trip: the accepted clients' models after local training.

    ``keep`` is a mask over the clients asked; ``clients``, ``rows`` [m, d] and
    ``loss`` [m] cover the accepted ones, in the order asked.
    """

    keep: np.ndarray
    clients: np.ndarray
    rows: torch.Tensor
    loss: torch.Tensor


@dataclass
class Context:
    """What an algorithm may use: the backend, local-training defaults, seed, initial model.

    :meth:`exchange` is the one path by which client models reach the server:
    it runs the clients' local training, counts the upload, and rejects
    malformed updates (non-finite values) before any aggregation or clustering,
    logging the client and recording it in ``rejected``.
    """

    sim: Simulator
    train: LocalTraining
    seed: int
    init_row: torch.Tensor
    comm: Comm = field(default_factory=Comm)
    rejected: list[int] = field(default_factory=list)
    client_transforms: list[UploadTransform] = field(default_factory=list)

    @property
    def n_clients(self) -> int:
        return self.sim.federation.n_clients

    @property
    def dim(self) -> int:
        return self.sim.layout.dim

    @property
    def train_sizes(self) -> np.ndarray:
        return self.sim.federation.train_sizes

    def fresh_rows(self, k: int, purpose: str) -> torch.Tensor:
        """``k`` independently initialised models [k, d], derived from ``(seed, purpose)``."""
        return torch.stack([init_row(self.sim.model, self.seed, purpose, i) for i in range(k)])

    def local(self, **changes: Any) -> LocalTraining:
        """The local-training defaults with some fields changed (e.g. ``mu``)."""
        return replace(self.train, **changes)

    def exchange(
        self,
        clients: np.ndarray,
        start: torch.Tensor,
        rnd: int,
        cfg: LocalTraining | None = None,
        purpose: str = "train",
        ints: int = 0,
    ) -> Exchange:
        """Clients train from ``start`` ([n, d] or [d]) and upload their models.

        Counts ``dim`` floats plus ``ints`` integers uploaded per client (the
        caller counts what it broadcast). Updates with NaN or Inf are rejected.
        """
        clients = np.asarray(clients, dtype=np.int64)
        result = self.sim.train(clients, start, cfg or self.train, rnd, purpose)
        rows = result.rows
        if self.client_transforms:
            start_rows = start.expand(len(clients), -1) if start.dim() == 1 else start
            for transform in self.client_transforms:
                rows = transform(clients, start_rows, rows, rnd)
        self.comm.upload(len(clients), floats=self.dim, ints=ints)
        keep = self.accept_finite(clients, rows, rnd, "update")
        mask = torch.as_tensor(keep)
        return Exchange(keep, clients[keep], rows[mask], result.loss[mask])

    def accept_finite(
        self, clients: np.ndarray, payload: torch.Tensor, rnd: int, what: str
    ) -> np.ndarray:
        """Mask over ``clients`` of those whose ``payload`` [n, ...] is all finite.

        The others are rejected: logged and recorded in ``rejected``. Used by
        :meth:`exchange` for models and by algorithms for other uploads (e.g.
        CFLGT's gradient trajectories).
        """
        keep = torch.isfinite(payload.flatten(1)).all(dim=1).numpy()
        for c in clients[~keep]:
            log.warning("round %d: rejected the %s of client %d (non-finite values)", rnd, what, c)
            self.rejected.append(int(c))
        return keep


def init_row(model: nn.Module, seed: int, purpose: str, index: int = 0) -> torch.Tensor:
    """A freshly initialised flat parameter row, derived from ``(seed, purpose, index)``.

    Every submodule's ``reset_parameters`` runs under a forked global RNG
    seeded from the derivation, so the result depends on nothing else.
    """
    from fedcluster.engine.flat import ParamLayout
    from fedcluster.rng import derive_seed

    fresh = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, purpose, index))
        for module in fresh.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
    return ParamLayout(fresh).flatten()


class Algorithm(ABC):
    """Server logic of one federated algorithm."""

    name: ClassVar[str]
    Params: ClassVar[type[AlgorithmParams]] = AlgorithmParams

    def __init__(self, params: AlgorithmParams, ctx: Context) -> None:
        self.params = params
        self.ctx = ctx

    @abstractmethod
    def init_state(self) -> State:
        """The server state before round 1."""

    @abstractmethod
    def run_round(self, state: State, rnd: int, selected: np.ndarray) -> float:
        """One communication round with the ``selected`` clients; updates ``state``.

        Returns the mean training loss of the participating clients
        (sample-weighted), counting payloads in ``self.ctx.comm``.
        """

    @abstractmethod
    def eval_rows(self, state: State) -> tuple[torch.Tensor, np.ndarray]:
        """Models [M, d] and, for every client, the index of the model it uses."""

    def evaluate(self, state: State, rnd: int) -> EvalResult:
        """Test accuracy of every client with the model it would use."""
        rows, model_of_client = self.eval_rows(state)
        clients = np.arange(self.ctx.n_clients)
        return self.ctx.sim.evaluate(clients, rows, model_of_client)

    def clusters(self, state: State) -> np.ndarray | None:
        """Cluster id of every client (−1 unassigned), or ``None`` for unclustered methods."""
        return None

    def diagnostics(self, state: State) -> dict[str, float]:
        """Per-round scalars worth logging (e.g. DCFL's Dunn index); ``diagnostics.csv``."""
        return {}

    def artifacts(self, state: State) -> dict[str, np.ndarray]:
        """Arrays saved with the run when the job ends (e.g. CFLGT's trajectories)."""
        return {}


ALGORITHMS: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: make an algorithm runnable by name."""
    ALGORITHMS[cls.name] = cls
    return cls


def weighted_loss(loss: torch.Tensor, sizes: np.ndarray) -> float:
    """Sample-weighted mean of per-client training losses (NaNs of empty clients ignored)."""
    w = torch.as_tensor(sizes, dtype=torch.float64)
    ok = ~torch.isnan(loss)
    if not bool(ok.any()):
        return float("nan")
    return float((loss.double()[ok] * w[ok]).sum() / w[ok].sum())
