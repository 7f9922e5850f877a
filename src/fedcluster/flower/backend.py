"""The Flower backend: any registered client computation sent to real nodes.

:class:`FlowerBackend` provides the Backend protocol
(:class:`~fedcluster.engine.backend.Backend`) like the simulator, but each
:meth:`~FlowerBackend.run` becomes one Flower message per node, sent through
the ServerApp's :class:`flwr.serverapp.Grid` and carrying every client of
that node that was asked (:func:`fedcluster.flower.protocol.encode_clients`);
the node (:mod:`fedcluster.flower.client`) runs the same computation for each
of them on its own data, one client at a time. The replies are checked
against the computation's declared reply and stacked. The algorithms run
unchanged on it (DESIGN principle 1): what a client computes and uploads is
the same, and the server never sees client data. It names no computation: a
new one needs no edit here.

The server knows the federation only through what the nodes report in
``query.setup`` (:func:`discover`, :class:`FederationInfo`): each node's client
ids, their sample counts (for sample-weighted averaging), the ground-truth
group where the node knows one (for purity), and the data shape (to build the
model). A client the node cannot serve (its data file is corrupt) is logged
with the node's error and stays in the federation, but is never asked: it
is a ``failed`` client of every request, with that error as the reason, as
the simulator's failing clients are. The clients of a node the SuperLink
reports offline are treated the same from then on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
from flwr.app import Message
from flwr.serverapp import Grid
from torch import nn

from fedcluster.data.drift import DriftEvent, planned_detail
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
from fedcluster.flower.collect import check_enough, collect

log = logging.getLogger(__name__)


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
    unavailable: dict[int, str] = field(default_factory=dict)
    """Client -> why its node cannot serve it (its ``query.setup`` error, e.g. a corrupt
    data file): it is not asked again, and fails every request with that reason."""

    @property
    def n_clients(self) -> int:
        return len(self.train_sizes)


NODE_WAIT_SECONDS = 60.0
"""How long :func:`discover` waits for the first node: Flower's simulation runtime
registers its nodes on a thread of its own, which can start after the ServerApp's
(seen on a loaded 2-core machine), and deployed nodes connect when they are up."""


def connected_nodes(grid: Grid, wait: float = NODE_WAIT_SECONDS, poll: float = 0.2) -> list[int]:
    """The ids of the nodes connected to ``grid``, once at least one is (sorted);
    waits up to ``wait`` seconds for the first one."""
    deadline = time.monotonic() + wait
    while True:
        nodes = sorted(grid.get_node_ids())
        if nodes:
            return nodes
        if time.monotonic() >= deadline:
            raise FlowerClientError(f"no Flower node connected within {wait:g} s")
        time.sleep(poll)


def discover(
    grid: Grid, experiment: str, seed: int, timeout: float | None = None
) -> tuple[FederationInfo, dict[int, int]]:
    """Ask every connected node which clients it holds; the federation and client → node map.

    Every client id 0..n−1 must be held by exactly one node that answered (n:
    the federation's size the nodes' manifests give, else the ids reported).
    A client its node cannot serve is logged with the node's error and kept
    (it will fail each request); a node that fails or does not answer is
    logged, and ends discovery with one line only when its clients are then
    missing.
    """
    nodes = connected_nodes(grid)
    config = {"experiment": experiment, "seed": seed}
    messages = [
        Message(protocol.request({}, config), dst_node_id=n, message_type=protocol.SETUP)
        for n in nodes
    ]
    what = protocol.SETUP
    got = collect(grid, messages, nodes, timeout, None, what=what, name=lambda n: f"node {n}")
    held: dict[int, tuple[int, dict]] = {}
    totals: set[int] = set()
    shape: tuple[int, tuple[int, ...]] | None = None
    for node, reply in got.replies.items():
        info = protocol.settings(reply.content)
        totals.add(int(info["n_clients"]))
        shape = shape or (int(info["n_classes"]), tuple(int(s) for s in info["input_shape"]))
        for j, c in enumerate(info[protocol.CLIENTS]):
            head = protocol.prefix(j)
            if int(c) in held:
                raise FlowerClientError(
                    f"client {c} is held by nodes {held[int(c)][0]} and {node}; "
                    "give each client's data to one node"
                )
            one = {k[len(head) :]: v for k, v in info.items() if k.startswith(head)}
            held[int(c)] = (int(node), one)
            if protocol.ERROR in one:
                log.warning(
                    "%s: client %s (node %s) cannot take part; it is left out and fails "
                    "every request: %s",
                    what,
                    c,
                    node,
                    one[protocol.ERROR],
                )
    totals.discard(-1)
    if len(totals) > 1:
        raise FlowerClientError(
            f"the nodes' data come from federations of {sorted(totals)} clients"
        )
    n = totals.pop() if totals else len(held)
    missing = sorted(set(range(n)) - set(held))
    extra = sorted(set(held) - set(range(n)))
    if missing or extra or shape is None:
        lost = "; ".join(f"node {k}: {r}" for k, r in got.failures.items()) or "none"
        raise FlowerClientError(
            f"clients {missing or extra} of 0..{n - 1} are held by no node that answered "
            f"{what} (nodes that failed: {lost})"
        )
    info = [held[c][1] for c in range(n)]
    groups = np.array([int(i["group"]) for i in info])
    federation = FederationInfo(
        train_sizes=np.array([int(i["train_size"]) for i in info]),
        test_sizes=np.array([int(i["test_size"]) for i in info]),
        groups=None if (groups < 0).any() else groups,
        n_classes=shape[0],
        input_shape=shape[1],
        unavailable={c: str(i[protocol.ERROR]) for c, i in enumerate(info) if protocol.ERROR in i},
    )
    return federation, {c: held[c][0] for c in range(n)}


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
        offline: dict[int, str] | None = None,
    ) -> None:
        self.grid = grid
        self.offline = {} if offline is None else offline
        """Node -> why: nodes the SuperLink reported offline, not asked again (shared
        by the jobs of a seed)."""
        self.min_replies = min_replies
        self.model = model
        self.layout = ParamLayout(model)
        self.federation = federation
        self.nodes = nodes
        self.seed = seed
        self.timeout = timeout
        self._experiment = experiment
        self.drifts: dict[int, list[DriftEvent]] = {}
        """Client -> the job's drift events so far: its node applies them to its own
        data before computing (every message carries its clients' events)."""

    def drift(self, event: DriftEvent) -> str:
        """Record a drift event of the job (the runner calls it at the start of the
        event's round, as the simulator applies it); its description where that does
        not depend on the client's data (which only its node holds)."""
        self.drifts.setdefault(event.client, []).append(event)
        return planned_detail(event) or "two of its labels, drawn on its node"

    def run(
        self, computation: ClientComputation, clients: np.ndarray, request: Request
    ) -> Returned:
        """One message per node for its clients among ``clients``; the replies checked
        against the computation's declared reply (:func:`assemble`).

        A client whose node fails (its error travels back), who fails on its node,
        or whose node does not answer within ``timeout``
        (``deployment.round_timeout``) is reported as failed: the channel treats it
        like the simulator's failing clients. Fewer replies than ``min_replies`` (a
        fraction of the clients asked) end the run with one line naming the
        clients and their errors (:func:`~fedcluster.flower.collect.check_enough`).
        A client its node declared unavailable at setup, or whose node the
        SuperLink has reported offline (no heartbeat for 2 × its interval, 60 s
        by default), is not asked (it fails with that reason) and does not count
        towards ``min_replies``: the run goes on without it.
        """
        clients = np.asarray(clients, dtype=np.int64)
        base = {
            "experiment": self._experiment,
            "seed": self.seed,
            "computation": computation.name,
            "computation_module": computation.module,
        }
        replies: list[Payload | str | None] = [None] * len(clients)
        unavailable = self.federation.unavailable
        by_node: dict[int, list[int]] = {}
        for i, c in enumerate(clients):
            node = self.nodes[int(c)]
            if int(c) in unavailable:  # its node said so at setup: not asked again
                replies[i] = f"unavailable: {unavailable[int(c)]}"
            elif node in self.offline:
                replies[i] = f"unavailable: its node is offline ({self.offline[node]})"
            else:
                by_node.setdefault(node, []).append(i)
        messages = []
        for node, positions in by_node.items():
            arrays, config = protocol.encode_clients(request, positions, clients[positions])
            drifted = {int(c): self.drifts[int(c)] for c in clients[positions] if c in self.drifts}
            if drifted:
                config[protocol.DRIFT] = protocol.encode_drift(drifted)
            messages.append(
                Message(
                    protocol.request(arrays, {**base, **config}),
                    dst_node_id=node,
                    message_type=protocol.message_type(computation.name),
                )
            )
        what = f"{computation.name} (clients {', '.join(map(str, clients))})"
        with self.timed():
            got = collect(
                self.grid,
                messages,
                list(by_node),
                self.timeout,
                None,
                what=what,
                name=lambda n: f"node {n} (clients {', '.join(map(str, clients[by_node[n]]))})",
            )
        for node in got.offline:
            self.offline[node] = got.failures[node]
            log.warning(
                "%s: node %s is offline; its clients (%s) are not asked again: %s",
                what,
                node,
                ", ".join(str(c) for c, n in self.nodes.items() if n == node),
                got.failures[node],
            )
        for node, positions in by_node.items():
            if node in got.replies:
                answers = protocol.decode_replies(got.replies[node].content, len(positions))
            else:
                answers = [got.failures[node]] * len(positions)
            for i, answer in zip(positions, answers, strict=True):
                replies[i] = answer
                if isinstance(answer, str) and node in got.replies:
                    log.warning("%s: client %d failed: %s", what, clients[i], answer)
        asked = [i for positions in by_node.values() for i in positions]
        failures = {int(clients[i]): replies[i] for i in asked if isinstance(replies[i], str)}
        check_enough(
            what,
            len(asked),
            len(asked) - len(failures),
            self.min_replies,
            "; ".join(f"client {c}: {r}" for c, r in failures.items()),
        )
        return assemble(computation, request, replies)
