"""The Flower backend: any registered client computation sent to real nodes.

:class:`FlowerBackend` provides the Backend protocol
(:class:`~fedcluster.engine.backend.Backend`) like the simulator, but each
:meth:`~FlowerBackend.run` becomes one Flower message per client, sent
through the ServerApp's :class:`flwr.serverapp.Grid` to the node that holds
the client (:mod:`fedcluster.flower.client`), which runs the same
computation on its own data; the replies are checked against the
computation's declared reply and stacked. The algorithms run unchanged on it
(DESIGN principle 1): what a client computes and uploads is the same, and
the server never sees client data. It names no computation: a new one needs
no edit here.

The server knows the federation only through what the nodes report in
``query.setup`` (:class:`FederationInfo`): client ids, sample counts (for
sample-weighted averaging), the ground-truth group where the node knows one
(for purity), and the data shape (to build the model).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flwr.app import Message
from flwr.serverapp import Grid
from torch import nn

from fedcluster.engine.clock import ClientClock
from fedcluster.engine.computation import (
    ClientComputation,
    Payload,
    Request,
    Returned,
    assemble,
)
from fedcluster.engine.flat import ParamLayout
from fedcluster.flower import protocol
from fedcluster.flower.collect import collect


class FlowerClientError(RuntimeError):
    """A node failed to answer a request."""


@dataclass(frozen=True)
class FederationInfo:
    """What the server learns of the federation from its nodes (``query.setup``)."""

    train_sizes: np.ndarray
    test_sizes: np.ndarray
    groups: np.ndarray | None
    n_classes: int
    input_shape: tuple[int, ...]

    @property
    def n_clients(self) -> int:
        return len(self.train_sizes)


def discover(
    grid: Grid, experiment: str, seed: int, timeout: float | None = None
) -> tuple[FederationInfo, dict[int, int]]:
    """Ask every connected node which client it holds; the federation and client → node map.

    Every client id 0..n−1 must be held by exactly one node.
    """
    nodes = sorted(grid.get_node_ids())
    if not nodes:
        raise FlowerClientError("no Flower node is connected")
    config = {"experiment": experiment, "seed": seed}
    messages = [
        Message(protocol.request({}, config), dst_node_id=n, message_type=protocol.SETUP)
        for n in nodes
    ]
    replies = _receive(grid, messages, timeout, [f"node {n}" for n in nodes])
    infos = [protocol.settings(r.content) for r in replies]
    clients = [int(i["client"]) for i in infos]
    if sorted(clients) != list(range(len(clients))):
        raise FlowerClientError(
            f"the {len(nodes)} nodes hold clients {sorted(clients)}; expected each of "
            f"0..{len(nodes) - 1} once (one node per client)"
        )
    order = np.argsort(clients)
    info = [infos[i] for i in order]
    groups = np.array([int(i["group"]) for i in info])
    federation = FederationInfo(
        train_sizes=np.array([int(i["train_size"]) for i in info]),
        test_sizes=np.array([int(i["test_size"]) for i in info]),
        groups=None if (groups < 0).any() else groups,
        n_classes=int(info[0]["n_classes"]),
        input_shape=tuple(int(s) for s in info[0]["input_shape"]),
    )
    return federation, dict(zip(clients, nodes, strict=True))


def _receive(
    grid: Grid, messages: list[Message], timeout: float | None, names: list[str]
) -> list[Message]:
    """Replies to ``messages`` (at most one per node) in their order; an error names
    the client or node that failed."""
    answers = _collect(grid, messages, timeout)
    for name, answer in zip(names, answers, strict=True):
        if isinstance(answer, str):
            raise FlowerClientError(f"{name} failed: {answer.removeprefix('node error: ')}")
    missing = [name for name, answer in zip(names, answers, strict=True) if answer is None]
    if missing:
        raise FlowerClientError(f"no reply within the timeout from {', '.join(missing)}")
    return [a for a in answers if a is not None and not isinstance(a, str)]


class FlowerBackend(ClientClock):
    """Client computations on Flower nodes, with the simulator's interface."""

    def __init__(
        self,
        grid: Grid,
        model: nn.Module,
        federation: FederationInfo,
        nodes: dict[int, int],
        experiment: str,
        seed: int,
        timeout: float | None = None,
        min_replies: float = 1.0,
    ) -> None:
        self.grid = grid
        self.min_replies = min_replies
        self.model = model
        self.layout = ParamLayout(model)
        self.federation = federation
        self.nodes = nodes
        self.seed = seed
        self.timeout = timeout
        self._experiment = experiment

    def run(
        self, computation: ClientComputation, clients: np.ndarray, request: Request
    ) -> Returned:
        """One message per client to the node that holds it; the replies checked
        against the computation's declared reply (:func:`assemble`).

        A node that fails (its error travels back) or does not answer within
        ``timeout`` (``deployment.round_timeout``) is reported as failed: the
        channel treats it like the simulator's failing clients. Fewer replies
        than ``min_replies`` (a fraction of those asked) end the run with one
        line naming the clients and their errors (:func:`~fedcluster.flower.collect.collect`).
        """
        clients = np.asarray(clients, dtype=np.int64)
        base = {
            "experiment": self._experiment,
            "seed": self.seed,
            "computation": computation.name,
            "computation_module": computation.module,
        }
        messages = []
        for i, c in enumerate(clients):
            one = request.client(i)
            config = {**base, **protocol.encode_settings(one.settings, int(c))}
            for key, value in protocol.encode_settings(
                one.own_settings[0] if one.own_settings else {}, int(c)
            ).items():
                config[protocol.OWN + key] = value
            messages.append(
                Message(
                    protocol.request(protocol.encode_request(one), config),
                    dst_node_id=self.nodes[int(c)],
                    message_type=protocol.message_type(computation.name),
                )
            )
        keys = list(range(len(messages)))
        with self.timed():
            got = collect(
                self.grid,
                messages,
                keys,
                self.timeout,
                self.min_replies,
                what=f"{computation.name} (clients {', '.join(map(str, clients))})",
            )
        replies: list[Payload | str | None] = [
            protocol.tensors(got.replies[i].content) if i in got.replies else got.failures[i]
            for i in keys
        ]
        return assemble(computation, request, replies)


def _collect(
    grid: Grid, messages: list[Message], timeout: float | None
) -> list[Message | str | None]:
    """Each message's reply, the error its node sent (a string), or None (no reply in time)."""
    by_node = {m.metadata.dst_node_id: i for i, m in enumerate(messages)}
    if len(by_node) != len(messages):
        raise ValueError("one request per node and call: a client was asked twice")
    out: list[Message | str | None] = [None] * len(messages)
    for r in grid.send_and_receive(messages, timeout=timeout):
        i = by_node.get(r.metadata.src_node_id)
        if i is not None:
            out[i] = f"node error: {r.error.reason}" if r.has_error() else r
    return out
