"""The algorithm interface shared by every method and both backends.

Modelled on FedJAX's ``FederatedAlgorithm`` (``init`` + ``apply`` over a small
server state) and pfl-research's split between what the server asks of
clients and what they compute (DESIGN principle 1):

- an algorithm is *server logic*: who gets which model, clustering,
  aggregation -- the methods of :class:`Algorithm`;
- what a client computes is a named client computation of the backend
  (:class:`~fedcluster.engine.backend.Backend`: ``train``,
  ``losses_and_grads``, ``evaluate``, ...), run for many clients at once by
  the simulator and for one client per node on Flower;
- every payload is counted in :class:`Comm` where it is sent, so
  ``bytes_up`` / ``bytes_down`` are exact and privacy can be reasoned about.

Server state is a plain ``dict`` of tensors, arrays and numbers, so a
checkpoint is ``torch.save(state)`` and a resumed run continues exactly.
"""

from __future__ import annotations

import copy
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from fedcluster.engine.backend import Backend
from fedcluster.engine.batches import LocalTraining
from fedcluster.engine.results import EvalResult
from fedcluster.engine.robust import Aggregator

if TYPE_CHECKING:
    from fedcluster.privacy import LocalDP

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
(e.g. a simulated faulty client)."""


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


@dataclass(frozen=True)
class UpdateBound:
    """Server-side rejection of absurdly large updates, in :meth:`Context.exchange`.

    An update u_i = w_i − w_start (after the client transforms) is rejected
    when ‖u_i‖ > ``max_norm``, or when ‖u_i‖ > ``norm_factor`` × the median
    norm of the finite updates of the same exchange -- a robust yardstick as
    long as fewer than half the clients misbehave (cf. the median rules of
    Byzantine-robust aggregation, Yin et al., ICML 2018). The relative rule
    needs at least ``MEDIAN_MIN_UPDATES`` finite updates (a median of one or
    two is no yardstick) and a positive median; ``None`` switches a rule off.
    The default factor of 100 only catches updates no honest client sends.
    """

    norm_factor: float | None = 100.0
    max_norm: float | None = None


MEDIAN_MIN_UPDATES = 3  # finite updates an exchange needs for UpdateBound's relative rule


@dataclass
class Context:
    """What an algorithm may use: the backend, local-training defaults, seed, initial model.

    :meth:`exchange` is the one path by which client models reach the server:
    it runs the clients' local training, counts the upload, and rejects
    malformed updates (non-finite values, norms beyond ``bound``) before any
    aggregation or clustering, logging the client and recording it in
    ``rejected``.

    Dynamic federations (:mod:`fedcluster.scenario`). The runner calls
    :meth:`start_round` before every round with the clients that are
    ``present`` (joined and not departed: the federation of that round,
    evaluated by :meth:`Algorithm.evaluate`), ``available`` (present and
    reachable: the runner selects among them, and an algorithm that contacts
    clients on its own -- a clustering round, a cold start -- contacts only
    these) and ``failing`` (they receive what the server sends but never
    reply). All clients are present and available, and none fails, unless
    told otherwise. A failing client's broadcast is counted by the algorithm
    as usual; it trains nothing and uploads nothing (:meth:`respond`).
    """

    sim: Backend
    train: LocalTraining
    seed: int
    init_row: torch.Tensor
    comm: Comm = field(default_factory=Comm)
    rejected: list[int] = field(default_factory=list)
    client_transforms: list[UploadTransform] = field(default_factory=list)
    privacy: LocalDP | None = None
    """Local DP of the uploads (:class:`~fedcluster.privacy.LocalDP`): the backend
    releases them where the client is, :meth:`exchange` records them in its ledger."""
    bound: UpdateBound = field(default_factory=UpdateBound)
    aggregate: Aggregator = field(default_factory=Aggregator)
    """The rule by which every algorithm averages client models (plain mean by default;
    :mod:`fedcluster.engine.robust`), per cluster where there are clusters."""
    failed: list[int] = field(default_factory=list)
    events: list[tuple[int, str, str]] = field(default_factory=list)
    """The round's ``(client, kind, detail)`` records: ``failed`` and ``rejected``."""
    present: np.ndarray = field(init=False)
    available: np.ndarray = field(init=False)
    failing: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.set_masks()

    def start_round(
        self,
        present: np.ndarray | None = None,
        available: np.ndarray | None = None,
        failing: np.ndarray | None = None,
    ) -> None:
        """Clear the round's bytes, rejections, failures and events; set the round's masks."""
        self.comm = Comm()
        self.rejected = []
        self.failed = []
        self.events = []
        self.set_masks(present, available, failing)

    def set_masks(
        self,
        present: np.ndarray | None = None,
        available: np.ndarray | None = None,
        failing: np.ndarray | None = None,
    ) -> None:
        """Who is present, available and failing (boolean [n_clients]).

        By default everyone is present and available and nobody fails.
        """
        n = self.n_clients
        self.present = np.ones(n, dtype=bool) if present is None else np.asarray(present)
        self.available = self.present.copy() if available is None else np.asarray(available)
        self.failing = np.zeros(n, dtype=bool) if failing is None else np.asarray(failing)

    def available_clients(self) -> np.ndarray:
        """Ids of the clients the server can reach this round."""
        return np.flatnonzero(self.available)

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

        Counts ``dim`` floats plus ``ints`` integers uploaded per replying
        client (the caller counts what it broadcast). Failing clients
        (:meth:`respond`) neither train nor upload; updates with NaN or Inf,
        or beyond ``bound`` (:meth:`accept_bounded`), are rejected.
        """
        clients = np.asarray(clients, dtype=np.int64)
        start_rows = start.expand(len(clients), -1) if start.dim() == 1 else start
        reply = self.respond(clients, rnd)
        if not reply.all():
            clients, start, start_rows = clients[reply], start_rows[reply], start_rows[reply]
        if not len(clients):
            return Exchange(reply, clients, torch.empty(0, self.dim), torch.empty(0))
        result = self.sim.train(
            clients, start, cfg or self.train, rnd, purpose, privacy=self.privacy
        )
        if self.privacy is not None:
            self.privacy.record(clients, result.steps, rnd)
        rows = result.rows
        for transform in self.client_transforms:
            rows = transform(clients, start_rows, rows, rnd)
        self.comm.upload(len(clients), floats=self.dim, ints=ints)
        keep = self.accept_finite(clients, rows, rnd, "update")
        keep &= self.accept_bounded(clients, rows - start_rows, keep, rnd)
        mask = torch.as_tensor(keep)
        asked = reply.copy()
        asked[reply] = keep
        return Exchange(asked, clients[keep], rows[mask], result.loss[mask])

    def respond(self, clients: np.ndarray, rnd: int) -> np.ndarray:
        """Mask over ``clients`` of those that reply; the ``failing`` ones are logged in ``failed``.

        A failing client received what the server sent (the caller's
        broadcast counts it) but sends nothing back; it is recorded once per
        round however often it is asked.
        """
        reply = ~self.failing[clients]
        for c in clients[~reply]:
            if int(c) not in self.failed:
                log.info("round %d: client %d did not reply", rnd, c)
                self.failed.append(int(c))
                self.events.append((int(c), "failed", "no reply"))
        return reply

    def _reject(self, client: int, rnd: int, what: str, reason: str) -> None:
        log.warning("round %d: rejected the %s of client %d (%s)", rnd, what, client, reason)
        self.rejected.append(int(client))
        self.events.append((int(client), "rejected", f"{what}: {reason}"))

    def accept_finite(
        self, clients: np.ndarray, payload: torch.Tensor, rnd: int, what: str
    ) -> np.ndarray:
        """Mask over ``clients`` of those whose ``payload`` [n, ...] is all finite.

        The others are rejected: logged and recorded in ``rejected``. Used by
        :meth:`exchange` for models and by algorithms for other uploads (e.g.
        CFLGT's gradient trajectories).
        """
        flat = payload.flatten(1)
        # A row sum is finite unless the row holds NaN/Inf (or overflows): check only those.
        keep = flat.sum(dim=1).isfinite()
        for i in torch.nonzero(~keep).flatten().tolist():
            keep[i] = bool(torch.isfinite(flat[i]).all())
        keep = keep.numpy()
        for c in clients[~keep]:
            self._reject(c, rnd, what, "non-finite values")
        return keep

    def accept_bounded(
        self, clients: np.ndarray, updates: torch.Tensor, finite: np.ndarray, rnd: int
    ) -> np.ndarray:
        """Mask over ``clients`` of the ``finite`` ones whose update [n, d] is within ``bound``.

        The others among the finite ones are rejected (see :class:`UpdateBound`).
        """
        norms = updates.norm(dim=1).double()
        overflow = torch.nonzero(~norms.isfinite()).flatten()  # float32 squares overflow
        norms[overflow] = updates[overflow].double().norm(dim=1)
        norms = norms.numpy()
        limit = math.inf if self.bound.max_norm is None else self.bound.max_norm
        ok_norms = norms[finite]
        if self.bound.norm_factor is not None and len(ok_norms) >= MEDIAN_MIN_UPDATES:
            median = float(np.median(ok_norms))
            if median > 0.0:
                limit = min(limit, self.bound.norm_factor * median)
        keep = finite & (norms <= limit)
        for c, norm in zip(clients[finite & ~keep], norms[finite & ~keep], strict=True):
            self._reject(c, rnd, "update", f"norm {norm:.3g} > {limit:.3g}")
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
        """Models [M, d] and, for every client, the index of the model it uses.

        Only present clients' entries are used (a client not present may get −1).
        """

    def evaluate(self, state: State, rnd: int) -> EvalResult:
        """Test accuracy of every present client with the model it would use."""
        rows, model_of_client = self.eval_rows(state)
        clients = np.flatnonzero(self.ctx.present)
        return self.ctx.sim.evaluate(clients, rows, model_of_client[clients])

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
