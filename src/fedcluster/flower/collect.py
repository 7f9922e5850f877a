"""Fault-tolerant collection of replies from real Flower nodes.

A deployment loses nodes: a device goes offline, its data is broken, its
ClientApp raises. :func:`collect` sends one request per client through the
ServerApp's :class:`flwr.serverapp.Grid`, waits at most
``deployment.round_timeout`` seconds, and returns the replies that arrived
together with, per client that did not answer, why (``timeout``, the node's
own error message from ``Message.error.reason``, or a refused push). Only
when fewer than ``deployment.min_replies`` of the clients asked answered does
it raise :class:`TooFewReplies`, one line naming the clients and reasons; the
caller treats the other missing clients like the simulator's failing ones
(``failed`` events, not aggregated).

Replies are matched to requests by message id (``reply_to_message_id``). The
Flower backend sends one message per node, carrying all the node's clients
asked (:mod:`fedcluster.flower.messages`), and counts ``min_replies`` over the
clients itself (:func:`check_enough`): a node's reply may hold some of its
clients' errors. The grid is polled with a short,
growing interval (from 20 ms to 0.5 s) instead of ``Grid.send_and_receive``'s
fixed 3 s, which would add up to 3 s to every round trip.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from fedcluster.errors import FedclusterError

if TYPE_CHECKING:
    from flwr.app import Message
    from flwr.serverapp import Grid

log = logging.getLogger(__name__)

TIMEOUT = "timeout"
NODE_UNAVAILABLE = 5
"""``flwr.common.constant.ErrorCode.NODE_UNAVAILABLE`` (Flower 1.42)."""


class TooFewReplies(FedclusterError):
    """Fewer clients replied than ``deployment.min_replies`` requires."""


Key = TypeVar("Key", bound=Hashable)
"""What names a message: a client id, or a node id when a message carries several clients."""


@dataclass
class Collected(Generic[Key]):
    """The replies that arrived and, per client that did not answer, the reason."""

    replies: dict[Key, Message] = field(default_factory=dict)
    failures: dict[Key, str] = field(default_factory=dict)
    offline: set[Key] = field(default_factory=set)
    """Keys whose node the SuperLink reported offline (Flower's ``NODE_UNAVAILABLE``
    error: no heartbeat within 2 × its interval)."""
    timed_out: set[Key] = field(default_factory=set)
    """Keys not answered within the timeout."""
    seconds: float = 0.0
    """From sending to the last reply that arrived (the slowest round trip measured)."""

    def describe_failures(self) -> str:
        """``client 3: timeout; client 5: node error: ...`` (one line)."""
        return "; ".join(f"client {k}: {r}" for k, r in self.failures.items())


def required(n_asked: int, min_replies: float) -> int:
    """How many of ``n_asked`` clients must reply (at least one when any was asked)."""
    return min(n_asked, max(1, math.ceil(min_replies * n_asked - 1e-9))) if n_asked else 0


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def check_enough(
    what: str, n_asked: int, n_replied: int, min_replies: float, failures: str
) -> None:
    """Raise :class:`TooFewReplies` (one line, ending with ``failures``) when fewer than
    ``min_replies`` of the ``n_asked`` clients replied."""
    need = required(n_asked, min_replies)
    if n_replied < need:
        raise TooFewReplies(
            f"{what}: {n_replied} of {n_asked} clients replied, "
            f"{need} needed (deployment.min_replies={min_replies:g}): " + failures
        )


def collect(
    grid: Grid,
    messages: Sequence[Message],
    keys: Sequence[Key],
    round_timeout: float | None = None,
    min_replies: float | None = 1.0,
    what: str = "request",
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    name: Callable[[Key], str] = lambda key: f"client {key}",
) -> Collected[Key]:
    """Send ``messages`` (named by ``keys``: one per client, or per node carrying
    several clients) and gather the replies.

    Waits until every message is answered or ``round_timeout`` seconds have passed
    (``None``: no limit). Raises :class:`TooFewReplies` when fewer than
    ``min_replies`` of the messages were answered without error (``None``: the
    caller counts, e.g. per client of a node's reply). ``name`` names a key in
    the log.
    """
    if len(messages) != len(keys):
        raise ValueError("collect: one key per message")
    out: Collected[Key] = Collected()
    if not messages:
        return out
    ids = list(grid.push_messages(list(messages)))
    pending: dict[str, Key] = {}
    for key, mid in zip(keys, ids, strict=True):
        if mid:
            pending[str(mid)] = key
        else:
            out.failures[key] = "the SuperLink did not accept the message"
    start = clock()
    deadline = None if round_timeout is None else start + round_timeout
    wait = 0.02
    while pending:
        for reply in grid.pull_messages(list(pending)):
            replied = pending.pop(str(reply.metadata.reply_to_message_id), None)
            if replied is None:
                continue
            if reply.has_error():
                out.failures[replied] = f"node error: {_one_line(reply.error.reason or '')}"
                if getattr(reply.error, "code", None) == NODE_UNAVAILABLE:
                    out.offline.add(replied)
            else:
                out.replies[replied] = reply
            out.seconds = clock() - start
        if not pending or (deadline is not None and clock() >= deadline):
            break
        pause = wait if deadline is None else min(wait, max(0.0, deadline - clock()))
        sleep(pause)
        wait = min(0.5, wait * 1.5)
    for key in pending.values():
        out.failures[key] = f"{TIMEOUT} (no reply within {round_timeout:g} s)"
        out.timed_out.add(key)
    for key, reason in out.failures.items():
        log.warning("%s: %s did not answer: %s", what, name(key), reason)
    if min_replies is not None:
        check_enough(what, len(messages), len(out.replies), min_replies, out.describe_failures())
    # keep the callers' order
    out.replies = {k: out.replies[k] for k in keys if k in out.replies}
    out.failures = {k: out.failures[k] for k in keys if k in out.failures}
    return out
