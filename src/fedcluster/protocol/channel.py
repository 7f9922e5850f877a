"""The one channel between an algorithm and its clients (DESIGN, "the client side").

Every request an algorithm makes of clients goes through :meth:`Channel.ask`,
which applies to every reply of every computation, in this order:

1. **who answers**: clients the scenario marks ``failing`` receive the request
   but never reply (logged once per round, ``failed`` events); a client whose
   backend reported no reply (a lost Flower node, a timeout) counts the same;
2. **local DP of what leaves the client**: for a computation with
   ``privacy="release"`` each asked client gets its release rule
   (:meth:`~fedcluster.privacy.ledger.LocalDP.ticket`) with the request, releases or
   withholds where it is, and the channel enters the release in the ledger; a
   withheld upload was never sent (no bytes, a ``withheld`` event); exempt
   computations say why (``exempt_because``; tested);
3. **rejection** of malformed replies, before any aggregation or clustering:
   a reply of another shape than declared (e.g. oversized), non-finite values,
   a computation's own bounds (``check``), and for a model upload the server's
   :class:`UpdateBound`; each is logged with the client and recorded in
   ``rejected`` and as a ``rejected`` event;
4. **byte counting**: what each asked client receives (its request's tensors,
   less what it already holds) and what each replying client uploads (the
   counted reply fields plus declared metadata integers), measured from the
   payload.

Traffic of measurements (evaluation, the oracle-initialisations some
baselines use) is counted apart in :attr:`Channel.measured`, not in the
round's ``bytes_up``/``bytes_down``. A computation that never leaves the
device (local training) is asked with ``on_device=True``: no bytes, no
failures, nothing released.

Simulated faulty clients (:mod:`fedcluster.experiment.scenario`) garble model uploads
after local DP (``client_transforms``), as a broken or malicious client would.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedcluster.config.schema import DEFAULT_NORM_FACTOR
from fedcluster.protocol.backend import Backend, run_summed
from fedcluster.protocol.computation import ClientComputation, Payload, Request, Returned

if TYPE_CHECKING:
    from fedcluster.privacy.ledger import LocalDP

log = logging.getLogger("fedcluster")

INT_BYTES = 4  # sample counts and cluster ids travel as int32

UploadTransform = Callable[[np.ndarray, torch.Tensor, torch.Tensor, int], torch.Tensor]
"""What a (simulated faulty) client does to its model before upload:
``(clients, start_rows, trained_rows, round) -> rows``."""


@dataclass
class Traffic:
    """Bytes sent by the server (down) and by clients (up)."""

    up: int = 0
    down: int = 0


@dataclass(frozen=True)
class UpdateBound:
    """Server-side rejection of absurdly large updates of a model upload.

    An update u_i = w_i − w_start (after the client transforms) is rejected
    when ‖u_i‖ > ``max_norm``, or when ‖u_i‖ > ``norm_factor`` × the median
    norm of the finite updates of the same request -- a robust yardstick as
    long as fewer than half the clients misbehave (cf. the median rules of
    Byzantine-robust aggregation, Yin et al., ICML 2018). The relative rule
    needs at least ``MEDIAN_MIN_UPDATES`` finite updates (a median of one or
    two is no yardstick) and a positive median; ``None`` switches a rule off.
    The default factor of 100 only catches updates no honest client sends.
    """

    norm_factor: float | None = DEFAULT_NORM_FACTOR
    max_norm: float | None = None


MEDIAN_MIN_UPDATES = 3  # finite updates a request needs for UpdateBound's relative rule


@dataclass
class Replies:
    """The accepted replies of one request, in the order asked.

    ``keep`` is a mask over the clients asked; ``clients`` and each field of
    ``fields`` ([m, ...]) cover the accepted ones.
    """

    keep: np.ndarray
    clients: np.ndarray
    fields: Payload

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.fields[name]


@dataclass
class Channel:
    """One per job; :meth:`start_round` resets the round's traffic, rejections and events."""

    backend: Backend
    seed: int
    privacy: LocalDP | None = None
    bound: UpdateBound = field(default_factory=UpdateBound)
    client_transforms: list[UploadTransform] = field(default_factory=list)
    traffic: Traffic = field(default_factory=Traffic)
    measured: Traffic = field(default_factory=Traffic)
    rejected: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    events: list[tuple[int, str, str]] = field(default_factory=list)
    """The round's ``(client, kind, detail)`` records: ``failed`` and ``rejected``."""
    update_norms: list[float] = field(default_factory=list)
    """Norms ‖w_i − w_start‖ of the round's accepted model updates (the clipping
    rules' scale, :mod:`fedcluster.algorithms.robust`)."""
    present: np.ndarray = field(init=False)
    available: np.ndarray = field(init=False)
    failing: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.set_masks()

    @property
    def n_clients(self) -> int:
        return self.backend.federation.n_clients

    def start_round(
        self,
        present: np.ndarray | None = None,
        available: np.ndarray | None = None,
        failing: np.ndarray | None = None,
        keep: bool = False,
    ) -> None:
        """Clear the round's bytes, rejections, failures and events; set the round's masks.

        With ``keep`` what was recorded before the round starts counts in it: the
        requests of an algorithm's ``init_state`` (an initial broadcast, a one-shot
        upload) are round 1's traffic, not dropped.
        """
        if not keep:
            self.traffic = Traffic()
            self.measured = Traffic()
            self.rejected = []
            self.failed = []
            self.events = []
            self.update_norms = []
        self.set_masks(present, available, failing)

    def set_masks(
        self,
        present: np.ndarray | None = None,
        available: np.ndarray | None = None,
        failing: np.ndarray | None = None,
    ) -> None:
        """Who is present, available and failing (boolean [n_clients]; default: all
        present and available, none failing; see :class:`~fedcluster.algorithms.base.Context`)."""
        n = self.n_clients
        self.present = np.ones(n, dtype=bool) if present is None else np.asarray(present)
        self.available = self.present.copy() if available is None else np.asarray(available)
        self.failing = np.zeros(n, dtype=bool) if failing is None else np.asarray(failing)

    # ------------------------------------------------------------------ ask
    def ask(
        self,
        computation: ClientComputation,
        clients: np.ndarray,
        request: Request,
        rnd: int,
        *,
        metadata_ints: int = 0,
        measurement: bool = False,
        on_device: bool = False,
    ) -> Replies:
        """Send ``request`` to ``clients``, run ``computation`` there, return the accepted replies.

        ``metadata_ints`` integers (a sample count, a cluster id) travel with each
        upload. ``measurement`` counts the traffic apart and asks every client
        (the experimenter's oracle: no failures). ``on_device`` runs a
        computation whose result never leaves the client (no traffic, no
        failures, no release).
        """
        clients = np.asarray(clients, dtype=np.int64)
        if on_device:
            fields = self.backend.run(computation, clients, request).fields
            return Replies(np.ones(len(clients), dtype=bool), clients, fields)
        traffic = self.measured if measurement else self.traffic
        traffic.down += request.bytes_down() * len(clients)
        reply = np.ones(len(clients), dtype=bool) if measurement else self.respond(clients, rnd)
        keep = reply.copy()
        if reply.any():
            asked = clients[reply]
            sub = request if reply.all() else subset_request(request, np.flatnonzero(reply))
            releases = (
                not measurement and self.privacy is not None and computation.privacy == "release"
            )
            if releases:
                sub = self._with_tickets(computation, sub, asked)
            returned = self.backend.run(computation, asked, sub)
            answered = self._answered(computation, asked, returned, rnd)
            sent = self._released(computation, asked[answered], returned, rnd) if releases else None
            per_reply = computation.bytes_up(sub) + INT_BYTES * metadata_ints
            n_sent = int(answered.sum()) if sent is None else int(sent.sum())
            traffic.up += per_reply * n_sent + returned.malformed_bytes
            accepted = self._accept(
                computation, asked[answered], sub, returned, rnd, measurement, sent
            )
            keep[reply] = answered
            keep[np.flatnonzero(reply)[answered]] = accepted
            fields = returned.fields
            if not accepted.all():
                ok_rows = torch.as_tensor(accepted)
                fields = {k: v[ok_rows] for k, v in fields.items()}
        else:
            fields = {
                k: torch.empty((0, *f.shape_for(request)), dtype=f.dtype)
                for k, f in computation.reply.items()
            }
        return Replies(keep, clients[keep], fields)

    def ask_summed(
        self, computation: ClientComputation, clients: np.ndarray, request: Request, rnd: int
    ) -> tuple[np.ndarray, torch.Tensor]:
        """Send ``request`` to ``clients`` and receive only the sum of their replies'
        one field (:func:`~fedcluster.protocol.backend.run_summed`: secure aggregation):
        the ids of the clients in the sum, and the sum. Failing clients and those the
        backend left out are recorded as failed; bytes are counted as for :meth:`ask`.
        Nothing individual reaches the server, so nothing is rejected here: the
        contribution bounds itself (:mod:`fedcluster.protocol.secure_sum`)."""
        clients = np.asarray(clients, dtype=np.int64)
        self.traffic.down += request.bytes_down() * len(clients)
        reply = self.respond(clients, rnd)
        asked = clients[reply]
        if not len(asked):
            (field_,) = computation.reply.values()
            return asked, torch.zeros(field_.shape_for(request), dtype=torch.float64)
        sub = request if reply.all() else subset_request(request, np.flatnonzero(reply))
        summed = run_summed(self.backend, computation, asked, sub)
        for i, reason in summed.failed.items():
            self._fail(int(asked[i]), rnd, reason)
        counted = asked[summed.counted]
        self.traffic.up += computation.bytes_up(sub) * len(counted)
        return counted, summed.total

    def _with_tickets(
        self, computation: ClientComputation, request: Request, clients: np.ndarray
    ) -> Request:
        assert self.privacy is not None
        self.privacy.check_release(computation)
        own = request.own_settings or tuple({} for _ in clients)
        tickets = tuple(
            {**s, "ticket": self.privacy.ticket(int(c))} for s, c in zip(own, clients, strict=True)
        )
        return replace(request, own_settings=tickets)

    def _answered(
        self, computation: ClientComputation, clients: np.ndarray, returned: Returned, rnd: int
    ) -> np.ndarray:
        """Mask of the clients whose reply came back well-formed; the others are
        recorded as failed (no reply) or rejected (malformed)."""
        for i, reason in returned.failed.items():
            self._fail(int(clients[i]), rnd, reason)
        for i, reason in returned.malformed.items():
            self._reject(int(clients[i]), rnd, _what(computation.name), reason)
        return returned.ok

    def _accept(
        self,
        computation: ClientComputation,
        clients: np.ndarray,
        request: Request,
        returned: Returned,
        rnd: int,
        measurement: bool,
        sent: np.ndarray | None,
    ) -> np.ndarray:
        """Mask over the answered ``clients``: transforms, finite and bound checks of the
        uploads that were ``sent`` (default all; a measurement gets only the checks
        of its own reply)."""
        fields = returned.fields
        ok_pos = np.flatnonzero(returned.ok)
        start = None
        if computation.update is not None and not measurement:
            name, _ = computation.update
            start = computation.start_rows(request, fields, ok_pos)
            for transform in self.client_transforms:
                fields[name] = transform(clients, start, fields[name], rnd)
        keep = np.ones(len(clients), dtype=bool) if sent is None else sent.copy()
        for name, spec in computation.reply.items():
            if spec.finite:
                keep &= self.accept_finite(clients, fields[name], rnd, computation.name, keep)
        if computation.check is not None:
            for i, reason in enumerate(computation.check(request, fields)):
                if reason and keep[i]:
                    keep[i] = False
                    self._reject(int(clients[i]), rnd, computation.name, reason)
        if start is not None:
            assert computation.update is not None
            name, _ = computation.update
            keep &= self.accept_bounded(clients, fields[name], start, keep, rnd)
        return keep

    def _released(
        self, computation: ClientComputation, clients: np.ndarray, returned: Returned, rnd: int
    ) -> np.ndarray:
        """Enter the answered clients' releases in the ledger; mask of those that released.

        A client whose budget did not allow the release withheld its upload where
        it is: it sent nothing (no bytes, a ``withheld`` event, not a rejection).
        """
        assert self.privacy is not None
        cost = computation.release_cost
        steps = returned.fields[cost] if cost else torch.ones(len(clients), dtype=torch.int64)
        released = self.privacy.record(clients, steps, rnd)
        for c in clients[~released]:
            self.events.append((int(c), "withheld", "privacy budget spent"))
        return released

    # ------------------------------------------------------------ failures
    def respond(self, clients: np.ndarray, rnd: int) -> np.ndarray:
        """Mask over ``clients`` of those that reply; the ``failing`` ones are logged in ``failed``.

        A failing client received what the server sent (counted) but sends
        nothing back; it is recorded once per round however often it is asked.
        """
        reply: np.ndarray = ~self.failing[clients]
        for c in clients[~reply]:
            self._fail(int(c), rnd, "no reply")
        return reply

    def _fail(self, client: int, rnd: int, reason: str) -> None:
        if client in self.failed:
            return
        if reason == "no reply":
            log.info("round %d: client %d did not reply", rnd, client)
        else:
            log.warning("round %d: client %d did not reply: %s", rnd, client, reason)
        self.failed.append(client)
        self.events.append((client, "failed", reason))

    def _reject(self, client: int, rnd: int, what: str, reason: str) -> None:
        log.warning("round %d: rejected the %s of client %d (%s)", rnd, what, client, reason)
        self.rejected.append(int(client))
        self.events.append((int(client), "rejected", f"{what}: {reason}"))

    # ----------------------------------------------------------- rejection
    def accept_finite(
        self,
        clients: np.ndarray,
        payload: torch.Tensor,
        rnd: int,
        what: str,
        among: np.ndarray | None = None,
    ) -> np.ndarray:
        """Mask over ``clients`` of those whose ``payload`` [n, ...] is all finite.

        The others (among ``among``, default all) are rejected: logged and
        recorded in ``rejected``.
        """
        if not payload.is_floating_point() or payload.numel() == 0:
            return np.ones(len(clients), dtype=bool)
        flat = payload.flatten(1) if payload.dim() > 1 else payload.unsqueeze(1)
        # A row sum is finite unless the row holds NaN/Inf (or overflows): check only those.
        finite = flat.sum(dim=1).isfinite()
        for i in torch.nonzero(~finite).flatten().tolist():
            finite[i] = bool(torch.isfinite(flat[i]).all())
        keep = finite.numpy()
        among = np.ones(len(clients), dtype=bool) if among is None else among
        for c in clients[~keep & among]:
            self._reject(c, rnd, _what(what), "non-finite values")
        return keep

    def accept_bounded(
        self,
        clients: np.ndarray,
        rows: torch.Tensor,
        start: torch.Tensor,
        finite: np.ndarray,
        rnd: int,
    ) -> np.ndarray:
        """Mask over ``clients`` of the ``finite`` ones whose update (uploaded ``rows``
        [n, d] minus their ``start`` rows [n, d]) is within ``bound``.

        The others among the finite ones are rejected (see :class:`UpdateBound`).
        """
        norms = row_distances(rows, start).numpy()
        limit = math.inf if self.bound.max_norm is None else self.bound.max_norm
        ok_norms = norms[finite]
        if self.bound.norm_factor is not None and len(ok_norms) >= MEDIAN_MIN_UPDATES:
            median = float(np.median(ok_norms))
            if median > 0.0:
                limit = min(limit, self.bound.norm_factor * median)
        keep = finite & (norms <= limit)
        for c, norm in zip(clients[finite & ~keep], norms[finite & ~keep], strict=True):
            self._reject(c, rnd, "update", f"norm {norm:.3g} > {limit:.3g}")
        self.update_norms.extend(norms[keep].tolist())
        return keep


NORM_CHUNK_ROWS = 64
"""Updates whose norms are taken at a time: a federation's [n, d] difference is never
held at once (at 2,400 clients of 159,010 parameters it would be 1.5 GB)."""


def row_distances(rows: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """‖rows_i − start_i‖₂ of each row [n] (float64), a chunk of rows at a time; rows
    whose float32 squares overflow are measured again in float64."""
    norms = torch.empty(len(rows), dtype=torch.float64)
    for lo in range(0, len(rows), NORM_CHUNK_ROWS):
        hi = lo + NORM_CHUNK_ROWS
        diff = rows[lo:hi] - start[lo:hi]
        chunk = diff.norm(dim=1).double()
        overflow = torch.nonzero(~chunk.isfinite()).flatten()
        chunk[overflow] = diff[overflow].double().norm(dim=1)
        norms[lo:hi] = chunk
    return norms


def _what(computation: str) -> str:
    """How a rejection names the payload (a model upload is an ``update``)."""
    return "update" if computation == "train" else computation


def subset_request(request: Request, positions: np.ndarray) -> Request:
    """The request for the clients at ``positions`` of those asked."""
    idx = torch.as_tensor(positions, dtype=torch.int64)
    own = {k: v[idx] for k, v in request.own.items()}
    own_settings = (
        None
        if request.own_settings is None
        else tuple(request.own_settings[int(i)] for i in positions)
    )
    return replace(request, own=own, own_settings=own_settings)
