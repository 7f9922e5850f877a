"""Client computations as units: declared once, run by any backend.

A :class:`ClientComputation` is everything a backend needs to run one thing a
client computes, whoever runs it:

- ``name``: registered in :data:`COMPUTATIONS`; on Flower it is the message
  type, and the ClientApp dispatches on it (:mod:`fedcluster.flower.client`);
- the **request** (:class:`Request`): tensors the server sends every asked
  client (``shared``, e.g. K cluster models), tensors of each client
  (``own``, e.g. its start row), and plain settings (round, purpose, the
  local-training hyperparameters) that travel as a Flower ``ConfigRecord``;
- what **one client computes** (``run_one_client(client, request)``, given the
  client's :class:`~fedcluster.protocol.client_side.ClientContext`: its data, the
  model, the training and evaluation helpers), and optionally the same for many
  clients at once (``batched_run(batch, request)``, given their
  :class:`~fedcluster.protocol.client_side.ClientBatch`: the same helpers,
  vectorised; what the simulator uses; a Flower node runs it on its one client);
- the **reply** it sends back (``reply``: each field's shape per client, and
  whether it is part of the algorithm's upload and so counted in
  ``bytes_up``), so sizes are measured from the payload, not hand-computed;
- how **local DP** treats the upload (``privacy``): ``release`` privatises it
  where the client is (:mod:`fedcluster.privacy.mechanisms`), or the computation is exempt
  with its reason in ``exempt_because``.

Modelled on FedJAX's ``for_each_client`` (a client computation as small
functions batched by the framework) and pfl-research's split between what a
user computes and what the server does with the aggregate. What a channel
does with the replies (failures, DP ledger, rejection, byte counting) is in
:mod:`fedcluster.protocol.channel`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import torch

from fedcluster.protocol.client_side import ClientBatch, ClientContext, ClientRunner

Payload = dict[str, torch.Tensor]
Settings = dict[str, Any]


@dataclass(frozen=True)
class Request:
    """What the server sends the asked clients, in their order.

    ``shared`` tensors go to every client, ``own`` tensors have one row per
    client (leading dimension n), ``settings`` are plain values
    (bool/int/float/str and lists of them), ``own_settings`` one dict per
    client (e.g. its local-DP release rule). ``held`` names payload entries
    the clients already received this round (e.g. IFCA's chosen model, one of
    the K models of its decision query): a real server sends an index, so
    they are not counted again in ``bytes_down``.
    """

    shared: Payload = field(default_factory=dict)
    own: Payload = field(default_factory=dict)
    settings: Settings = field(default_factory=dict)
    own_settings: tuple[Settings, ...] | None = None
    held: frozenset[str] = frozenset()
    pick: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    """``{name: (shared field, own index field)}``: client i receives only row
    ``shared[field][own[index][i]]`` as ``name`` (e.g. the model it is evaluated with)."""
    tied: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """``{shared field: columns}``: the columns (row positions) of a shared ``[K, d]``
    field that hold the same values in all K rows (IFCA's weight sharing: the layers
    the cluster models share), sent once instead of K times."""

    def client(self, i: int) -> Request:
        """Client ``i``'s self-contained part: its own rows (leading dimension 1),
        its picked rows, the shared tensors not picked from, and its settings."""
        indexes = {index for _, index in self.pick.values()}
        own = {k: v[i : i + 1] for k, v in self.own.items() if k not in indexes}
        for name, (source, index) in self.pick.items():
            own[name] = self.shared[source][int(self.own[index][i])].unsqueeze(0)
        sources = {source for source, _ in self.pick.values()}
        own_settings = None if self.own_settings is None else (self.own_settings[i],)
        return replace(
            self,
            shared={k: v for k, v in self.shared.items() if k not in sources},
            own=own,
            own_settings=own_settings,
            pick={},
        )

    def settings_of(self, i: int) -> Settings:
        """Client ``i``'s settings: the shared ones updated with its own."""
        if self.own_settings is None:
            return self.settings
        return {**self.settings, **self.own_settings[i]}

    def rows(self, name: str, positions: np.ndarray) -> torch.Tensor:
        """Row field ``name`` [m, d] of the clients at ``positions`` among those asked:
        their own rows (all of them in order: the field itself, not a copy), or the
        shared row broadcast."""
        if name in self.own:
            rows = self.own[name]
            if np.array_equal(positions, np.arange(len(rows))):
                return rows
            return rows[torch.as_tensor(positions, dtype=torch.int64)]
        return self.shared[name].expand(len(positions), -1)

    def bytes_down(self) -> int:
        """Bytes each client receives: its tensors that it does not already hold."""
        sources = {source for source, _ in self.pick.values()}
        indexes = {index for _, index in self.pick.values()}  # the server's, not sent
        sent = {k: v for k, v in self.shared.items() if k not in sources}
        total = sum(_nbytes(v) - self._tied_bytes(k) for k, v in sent.items() if k not in self.held)
        own = {k: v for k, v in self.own.items() if k not in self.held and k not in indexes}
        rows = sum(_nbytes(v[0]) for v in own.values() if len(v))
        picked = sum(_nbytes(self.shared[source][0]) for source, _ in self.pick.values())
        return total + rows + picked

    def _tied_bytes(self, name: str) -> int:
        """What sending the tied columns of ``shared[name]`` once saves: K − 1 copies.

        The columns must hold one value per column (NaN equal to NaN), or the
        count would not be the payload's: a ``ValueError`` otherwise.
        """
        columns = self.tied.get(name)
        if columns is None:
            return 0
        part = self.shared[name][:, columns]
        first = part[:1]
        if not ((part == first) | (part.isnan() & first.isnan())).all():
            raise ValueError(f"request field {name!r}: its tied columns differ between rows")
        return (len(part) - 1) * _nbytes(first)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class ReplyField:
    """One field of a client's reply: its shape per client and whether it is uploaded.

    ``shape`` is a tuple or a function of the request (e.g. ``(K,)`` for K
    models asked). ``counted`` fields are the algorithm's upload and count in
    ``bytes_up``; the others are the experimenter's instrumentation that a
    deployment would not need (e.g. the training loss reported in metrics).
    ``dtype`` is what the field travels as; a ``finite`` field with NaN or Inf
    gets the reply rejected (instrumentation such as an empty client's NaN loss
    is not checked). A ``samples`` field reports the client's sample count of the
    request's split (setting ``split``, default ``test``): a server that knows the
    client's sizes (Flower: :func:`fedcluster.flower.verify.wrong_count`) rejects a
    reply whose count differs.
    """

    shape: tuple[int, ...] | Callable[[Request], tuple[int, ...]]
    counted: bool = True
    dtype: torch.dtype = torch.float32
    finite: bool = True
    samples: bool = False

    def shape_for(self, request: Request) -> tuple[int, ...]:
        return self.shape(request) if callable(self.shape) else tuple(self.shape)

    def nbytes(self, request: Request) -> int:
        n = int(np.prod(self.shape_for(request), dtype=np.int64))
        return n * torch.empty(0, dtype=self.dtype).element_size()


BatchedRun = Callable[[ClientBatch, Request], Payload]
OneClientRun = Callable[[ClientContext, Request], Payload]
Release = Callable[[Request, Payload, np.ndarray, int], Payload]
"""Local DP of an upload, run where the client is: ``(request, reply, global client
ids, seed) -> released reply`` (the request's own settings carry each client's
release rule)."""


@dataclass(frozen=True)
class ClientComputation:
    """A named client computation (module docstring). Give ``run_one_client``,
    ``batched_run`` or both; a backend prefers ``batched_run``."""

    name: str
    reply: Mapping[str, ReplyField]
    run_one_client: OneClientRun | None = None
    batched_run: BatchedRun | None = None
    privacy: Literal["release", "exempt"] = "exempt"
    release: Release | None = None
    exempt_because: str = ""
    check: Callable[[Request, Payload], list[str | None]] | None = None
    """Extra per-client bounds of a reply (a reason to reject, or None)."""
    update: tuple[str, str] | None = None
    """``(reply field, request field)``: the reply is a model trained from that start
    row, so the server's update bound and simulated faulty clients apply to it."""
    start_index: str | None = None
    """With ``update``: a reply field holding the index of the row of the request field
    the client trained from (a device that chose its start among K models)."""
    release_cost: str | None = None
    """Reply field holding what a release costs the client's budget at record level
    (the DP-SGD steps of a training); without it a release costs one step."""

    def __post_init__(self) -> None:
        if self.run_one_client is None and self.batched_run is None:
            raise ValueError(f"computation {self.name}: give run_one_client or batched_run")
        if (self.privacy == "release") != (self.release is not None):
            raise ValueError(f"computation {self.name}: privacy 'release' needs a release")
        if self.privacy == "exempt" and not self.exempt_because:
            raise ValueError(f"computation {self.name}: say why local DP does not apply")

    @property
    def module(self) -> str:
        """The module that defines it: a Flower node imports it to find the computation."""
        fn = self.batched_run or self.run_one_client
        return fn.__module__

    def run(self, runner: ClientRunner, clients: np.ndarray, request: Request) -> Payload:
        """Run where the clients are: replies stacked [n, ...], released under local DP.

        ``clients`` are positions in ``runner``'s federation (a Flower node: [0]).
        When the request carries release rules (``ticket`` in its own settings),
        the upload is privatised (or withheld) here, before it leaves the client.
        """
        batch = ClientBatch(runner, clients)
        reply = self.compute(batch, request)
        own = request.own_settings
        if self.release is not None and own and "ticket" in own[0]:
            reply = self.release(request, reply, batch.ids, batch.seed)
        return reply

    def compute(self, batch: ClientBatch, request: Request) -> Payload:
        """What the clients of ``batch`` compute, stacked [n, ...]: the batched form, or
        the per-client one client by client (no release: another computation's client
        side may call it as a step of its own)."""
        if self.batched_run is not None:
            return self.batched_run(batch, request)
        assert self.run_one_client is not None
        replies = [
            self.run_one_client(batch.client(j), request.client(j)) for j in range(len(batch))
        ]
        return {k: torch.stack([torch.as_tensor(r[k]) for r in replies]) for k in self.reply}

    def start_rows(self, request: Request, fields: Payload, positions: np.ndarray) -> torch.Tensor:
        """The start rows [m, d] of the model uploads ``fields`` of the clients at
        ``positions`` among those asked (``update``'s request field, or its row each
        client chose: ``start_index``; an index out of range reads the nearest row, and
        the computation's ``check`` rejects it)."""
        assert self.update is not None
        _, name = self.update
        if self.start_index is not None:
            rows = request.shared[name]
            return rows[fields[self.start_index].long().clamp(0, len(rows) - 1)]
        return request.rows(name, positions)

    def bytes_up(self, request: Request) -> int:
        """Bytes of one client's upload: its counted reply fields."""
        return sum(f.nbytes(request) for f in self.reply.values() if f.counted)


COMPUTATIONS: dict[str, ClientComputation] = {}


def register_computation(computation: ClientComputation) -> ClientComputation:
    """Make ``computation`` runnable by name (on Flower: the message type)."""
    known = COMPUTATIONS.get(computation.name)
    if known is not None and known is not computation:
        raise ValueError(f"a client computation named {computation.name!r} is registered already")
    COMPUTATIONS[computation.name] = computation
    return computation


def lookup_computation(name: str, module: str | None = None) -> ClientComputation:
    """The computation registered as ``name``, importing ``module`` (its home) if needed."""
    if name not in COMPUTATIONS and module:
        importlib.import_module(module)
    if name not in COMPUTATIONS:
        raise KeyError(f"no client computation named {name!r} (known: {sorted(COMPUTATIONS)})")
    return COMPUTATIONS[name]


@dataclass
class Returned:
    """What a backend got back for one computation, in the order asked.

    ``fields`` hold the well-formed replies stacked ([m, ...], m = ``ok.sum()``);
    ``failed`` maps the position of each client that never replied to why
    (timeout, its node's error), ``malformed`` each client whose reply did
    not have the declared fields and shapes to what was wrong.
    """

    fields: Payload
    ok: np.ndarray
    failed: dict[int, str] = field(default_factory=dict)
    malformed: dict[int, str] = field(default_factory=dict)
    malformed_bytes: int = 0
    """What the malformed replies' upload fields weighed (they were sent all the same)."""


def assemble(
    computation: ClientComputation, request: Request, replies: list[Payload | str | None]
) -> Returned:
    """Stack per-client replies after checking each against the declared reply.

    An entry is a reply, a string (the client's error: it failed) or None (no
    reply). A reply with a missing field, or a field of another shape than
    declared (e.g. an oversized payload), is malformed and left out.
    """
    ok = np.zeros(len(replies), dtype=bool)
    failed: dict[int, str] = {}
    malformed: dict[int, str] = {}
    malformed_bytes = 0
    good: list[Payload] = []
    for i, reply in enumerate(replies):
        if reply is None or isinstance(reply, str):
            failed[i] = reply or "no reply"
            continue
        problem = _reply_problem(computation, request.client(i), reply)
        if problem:
            malformed[i] = problem
            malformed_bytes += sum(
                _nbytes(torch.as_tensor(reply[k]))
                for k, f in computation.reply.items()
                if f.counted and k in reply
            )
            continue
        ok[i] = True
        good.append(reply)
    fields = {
        k: torch.stack([torch.as_tensor(r[k]).to(f.dtype) for r in good])
        if good
        else torch.empty((0, *f.shape_for(request)), dtype=f.dtype)
        for k, f in computation.reply.items()
    }
    return Returned(fields, ok, failed, malformed, malformed_bytes)


def _reply_problem(computation: ClientComputation, request: Request, reply: Payload) -> str:
    for name, spec in computation.reply.items():
        if name not in reply:
            return f"no {name!r} in the reply"
        value = torch.as_tensor(reply[name])
        expected = spec.shape_for(request)
        if tuple(value.shape) != expected:
            return f"{name} has shape {tuple(value.shape)}, expected {expected}"
    extra = sorted(set(reply) - set(computation.reply))
    return f"unexpected reply fields {extra}" if extra else ""
