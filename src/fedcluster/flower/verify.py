"""What the ServerApp checks in a node's report before it uses any of it.

A node is trusted with nothing the server can check. Its ``query.setup`` reply
(:func:`setup_report`) must hold its client ids, each client's sample counts
(non-negative integers at most :data:`MAX_CLIENT_SAMPLES`: they become
averaging weights) and, where it reports them, the federation's size, number
of classes (at most :data:`~fedcluster.data.screen.MAX_CLASSES`: the server
builds the model's output layer from it) and input shape (at most
:data:`~fedcluster.data.screen.MAX_FEATURES` values per sample). Anything else
is a :class:`BadReport`, one line, and the node is left out of the federation
(:func:`fedcluster.flower.flower_backend.discover`).

A computation's reply field that reports a client's sample count
(:attr:`~fedcluster.protocol.computation.ReplyField.samples`, e.g. the
evaluation's ``count``) must equal the size the server agreed to at setup
(the server's manifest, or the node's own ``query.setup``): :func:`wrong_count`.
Without it one node could weight the federation's accuracy with counts of its
choice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedcluster.config.limits import MAX_COUNT
from fedcluster.data.screen import MAX_CLASSES, MAX_FEATURES
from fedcluster.errors import FedclusterError
from fedcluster.flower import messages
from fedcluster.protocol.computation import ClientComputation, Request

MAX_CLIENT_SAMPLES = MAX_COUNT
"""The most samples per client and split a node may report."""


class BadReport(FedclusterError):
    """A node's reply that the server cannot use (its message names the fault)."""


@dataclass(frozen=True)
class SetupReport:
    """A node's ``query.setup`` reply, checked."""

    n_clients: int
    """The federation's size as the node's manifest gives it (-1: not known)."""
    shape: tuple[int, tuple[int, ...]] | None
    """``(n_classes, input_shape)`` where the node reports them."""
    clients: list[tuple[int, dict[str, Any]]]
    """Each client's id and what the node reports of it (``train_size``,
    ``test_size``, ``group``, and ``sha256`` / ``error`` where present)."""

    @property
    def ids(self) -> list[int]:
        return [c for c, _ in self.clients]


def _integer(value: Any, what: str, low: int, high: int) -> int:
    """``value`` as an int in ``low..high``, else :class:`BadReport` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise BadReport(f"{what} is {value!r}, not an integer")
    if not low <= int(value) <= high:
        raise BadReport(f"{what} is {int(value)}, outside {low}..{high}")
    return int(value)


def _parts(content: Any) -> tuple[Mapping[str, torch.Tensor], Mapping[str, Any]]:
    """A reply's tensors and settings, or :class:`BadReport` when a record is missing
    or unreadable."""
    for record in ("arrays", "config"):
        if content is None or record not in content:
            raise BadReport(f"the reply has no {record!r} record")
    try:
        return messages.tensors(content), messages.settings(content)
    except (AssertionError, TypeError, ValueError) as exc:
        raise BadReport(f"the reply's records are unreadable ({exc})") from None


def setup_report(content: Any) -> SetupReport:
    """The checked ``query.setup`` reply of a node (its message's content)."""
    _, info = _parts(content)
    if messages.CLIENTS not in info:
        raise BadReport(f"the reply has no {messages.CLIENTS!r}")
    raw = info[messages.CLIENTS]
    if not isinstance(raw, list):
        raise BadReport(f"{messages.CLIENTS!r} is {raw!r}, not a list of client ids")
    ids = [_integer(c, "a client id", 0, MAX_COUNT) for c in raw]
    if len(set(ids)) != len(ids):
        raise BadReport(f"client ids repeat: {ids}")
    n = _integer(info.get("n_clients", -1), "n_clients", -1, MAX_COUNT)
    shape = None
    if "n_classes" in info:
        n_classes = _integer(info["n_classes"], "n_classes", 1, MAX_CLASSES)
        dims = info.get("input_shape")
        if not isinstance(dims, list) or not dims:
            raise BadReport(f"input_shape is {dims!r}, not a list of sizes")
        dims = [_integer(d, "an input_shape size", 1, MAX_FEATURES) for d in dims]
        if int(np.prod(dims, dtype=np.float64)) > MAX_FEATURES:
            raise BadReport(f"input_shape {dims} holds more than {MAX_FEATURES} values")
        shape = (n_classes, tuple(dims))
    clients = []
    for j, c in enumerate(ids):
        head = messages.prefix(j)
        one = {k[len(head) :]: v for k, v in info.items() if k.startswith(head)}
        for size in ("train_size", "test_size"):
            if size not in one:
                raise BadReport(f"client {c}: no {size}")
            one[size] = _integer(one[size], f"client {c}'s {size}", 0, MAX_CLIENT_SAMPLES)
        group = one.get("group", -1)
        one["group"] = None if group == -1 else _integer(group, f"client {c}'s group", 0, MAX_COUNT)
        clients.append((c, one))
    return SetupReport(n, shape, clients)


def replies_of(content: Any, n: int) -> list[dict[str, torch.Tensor] | str]:
    """The ``n`` clients' replies of a node's message (:func:`protocol.decode_replies`),
    or :class:`BadReport` when the message is malformed."""
    _parts(content)
    try:
        return messages.decode_replies(content, n)
    except (AssertionError, KeyError, TypeError, ValueError) as exc:
        raise BadReport(f"the reply is unreadable ({exc})") from None


def wrong_count(
    computation: ClientComputation,
    request: Request,
    position: int,
    reply: Mapping[str, Any],
    sizes: Mapping[str, int],
) -> str | None:
    """Why a client's ``reply`` reports another sample count than ``sizes`` (the
    client's ``{"train": n, "test": m}`` as agreed at setup); ``None`` when it does not
    (or the reply lacks the field: :func:`~fedcluster.protocol.computation.assemble`
    rejects that)."""
    split = str(request.settings_of(position).get("split", "test"))
    for name, spec in computation.reply.items():
        if not spec.samples or name not in reply:
            continue
        value = torch.as_tensor(reply[name])
        if value.numel() != 1 or split not in sizes:
            continue
        reported = value.item()
        if reported != sizes[split]:
            return f"{name} {reported!r}, but the client's {split} split has {sizes[split]} samples"
    return None
