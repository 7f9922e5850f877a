"""The Flower backend: any registered client computation sent to real nodes.

:class:`FlowerBackend` provides the Backend protocol
(:class:`~fedcluster.protocol.backend.Backend`) like the simulator, but each
:meth:`~FlowerBackend.run` becomes one Flower message per node, sent through
the ServerApp's :class:`flwr.serverapp.Grid` and carrying every client of
that node that was asked (:func:`fedcluster.flower.messages.encode_clients`);
the node (:mod:`fedcluster.flower.client`) runs the same computation for each
of them on its own data, one client at a time. The replies are checked
against the computation's declared reply and stacked. The algorithms run
unchanged on it: what a client computes and uploads is
the same, and the server never sees client data. It names no computation: a
new one needs no edit here.

The server knows the federation through what the nodes report in
``query.setup`` (:func:`discover`, :class:`FederationInfo`): each node's client
ids, their sample counts (for sample-weighted averaging), the ground-truth
group where the node knows one (for purity), the data shape (to build the
model) and each client file's SHA-256 -- or, given the server's copy of the
export's manifest, through that manifest, against which the nodes' hashes are
checked. Nothing a node reports is used before :mod:`fedcluster.flower.verify`
checks it: a node whose report is malformed, out of bounds or in conflict with
the manifest or the other nodes is refused (``refused`` events), and a reply
whose sample count differs from the agreed one is rejected. A client the node
cannot serve (its data file is corrupt, or differs from the server's manifest)
is logged with the reason and stays in the federation, but is out of reach:
never asked, not available for selection, a ``failed`` client of every
request that names it, as the simulator's failing clients are. The clients
of a node that is lost (reported offline by the SuperLink, or silent past the
timeout) are out of reach until a rediscovery finds the node again (:class:`Fleet`,
:meth:`FlowerBackend.rediscover`: at every round start and end and before
every request, never waiting): ``rejoined`` or ``joined`` events.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from flwr.app import Message
from flwr.serverapp import Grid
from torch import nn

from fedcluster.config.schema import DeploymentConfig
from fedcluster.data.drift import DriftEvent, planned_detail
from fedcluster.engine.clock import ClientClock
from fedcluster.engine.flat import ParamLayout
from fedcluster.errors import FedclusterError
from fedcluster.flower import messages as protocol
from fedcluster.flower import secure
from fedcluster.flower.collect import Collected, TooFewReplies, check_enough, collect, required
from fedcluster.flower.nodedata import NodeManifest
from fedcluster.flower.verify import BadReport, SetupReport, replies_of, setup_report, wrong_count
from fedcluster.protocol.backend import Summed
from fedcluster.protocol.computation import ClientComputation, Payload, Request, Returned, assemble

log = logging.getLogger(__name__)


class FlowerClientError(FedclusterError, RuntimeError):
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
    """Client -> why it is out of reach at discovery (its node's ``query.setup`` error,
    e.g. a corrupt data file; a hash that differs from the server's manifest; no node
    serving it): the seed's :class:`Fleet` starts from it."""
    refused: dict[int, tuple[list[int], str]] = field(default_factory=dict)
    """Node -> (the federation's clients it claimed, why it is left out): its report
    failed the server's checks (:mod:`fedcluster.flower.verify`)."""

    @property
    def n_clients(self) -> int:
        return len(self.train_sizes)


NODE_WAIT_SECONDS = 60.0
"""How long :func:`discover` waits for the first node: Flower's simulation runtime
registers its nodes on a thread of its own, which can start after the ServerApp's
(seen on a loaded 2-core machine), and deployed nodes connect when they are up."""

FIRST_TIMEOUT_FLOORS = 10
"""Before any round trip is measured (discovery), the measured timeout is this many
``timeout_floor``s: the first requests load each node's data and model."""


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


def _setup_messages(nodes: list[int], experiment: str, seed: int) -> list[Message]:
    """One ``query.setup`` message per node of ``nodes``."""
    config = {"experiment": experiment, "seed": seed}
    return [
        Message(protocol.request({}, config), dst_node_id=n, message_type=protocol.SETUP)
        for n in nodes
    ]


def _ask_setup(
    grid: Grid, nodes: list[int], experiment: str, seed: int, timeout: float | None
) -> tuple[Collected[int], dict[int, SetupReport], dict[int, str]]:
    """``query.setup`` of ``nodes``: per node that answered, its checked report; per
    node whose reply is unusable, why (:func:`~fedcluster.flower.verify.setup_report`)."""
    messages = _setup_messages(nodes, experiment, seed)
    got = collect(
        grid, messages, nodes, timeout, None, what=protocol.SETUP, name=lambda n: f"node {n}"
    )
    reports: dict[int, SetupReport] = {}
    refused: dict[int, str] = {}
    for node, reply in got.replies.items():
        try:
            reports[int(node)] = setup_report(reply.content)
        except BadReport as exc:
            refused[int(node)] = str(exc)
    return got, reports, refused


def refusal(client: int, node: int, one: Mapping, expected: NodeManifest | None) -> str | None:
    """Why ``client`` of ``node`` cannot take part: its node's error, or its data file's
    SHA-256 (as the node computed it) differing from the server's manifest; ``None``
    when it can. Names the client's file, never a node's path."""
    if protocol.ERROR in one:
        return str(one[protocol.ERROR])
    if expected is None:
        return None
    entry = expected.clients.get(client)
    if entry is None:
        return f"the server's manifest has no client {client}"
    if str(one.get("sha256", "")) != entry["sha256"]:
        return (
            f"DataError: {entry['file']}: SHA-256 differs from the server's manifest "
            f"(node {node} holds other data than was exported)"
        )
    return None


Reported = TypeVar("Reported", bound=Hashable)


def _majority(values: dict[int, Reported], what: str) -> Reported:
    """The value most nodes report (``values``: node -> value); one line when two
    values are reported by equally many nodes."""
    counts = Counter(values.values()).most_common()
    if len(counts) > 1 and counts[0][1] == counts[1][1]:
        raise FlowerClientError(
            f"{protocol.SETUP}: as many nodes report {what} {counts[0][0]} as "
            f"{counts[1][0]}; give every node data of the same federation"
        )
    return counts[0][0]


def _refuse_dissenters(
    reports: dict[int, SetupReport], refused: dict[int, str], expected: NodeManifest | None
) -> tuple[int | None, tuple[int, tuple[int, ...]] | None]:
    """The federation's size and ``(n_classes, input_shape)``: the server's manifest's,
    else what most nodes report; a node reporting others, a client id outside the
    federation (or the manifest), or a client another node claims too is moved from
    ``reports`` to ``refused`` (why)."""
    totals = {node: r.n_clients for node, r in reports.items() if r.n_clients != -1}
    shapes = {node: r.shape for node, r in reports.items() if r.shape is not None}
    n: int | None
    shape: tuple[int, tuple[int, ...]] | None
    if expected is not None:
        n = expected.n_clients or len(expected.clients)
        shape = (expected.n_classes, expected.input_shape)
    else:
        n = _majority(totals, "a federation of") if totals else None
        shape = _majority(shapes, "(n_classes, input_shape)") if shapes else None
    for node, report in list(reports.items()):
        foreign = [c for c in report.ids if n is not None and c >= n]
        if expected is not None:
            foreign = [c for c in report.ids if c not in expected.clients]
        if node in totals and totals[node] != n:
            refused[node] = f"it reports a federation of {totals[node]} clients, not {n}"
        elif node in shapes and shapes[node] != shape:
            refused[node] = f"it reports (n_classes, input_shape) {shapes[node]}, not {shape}"
        elif foreign:
            refused[node] = f"it claims clients {foreign}, not in the federation"
    claims: dict[int, list[int]] = {}
    for node, report in reports.items():
        if node not in refused:
            for c in report.ids:
                claims.setdefault(c, []).append(node)
    for c, holders in sorted(claims.items()):
        if len(holders) < 2:
            continue
        # with the server's manifest, the one node holding the exported file keeps it
        good = [
            node
            for node in holders
            if refusal(c, node, dict(reports[node].clients)[c], expected) is None
        ]
        keep = good[0] if expected is not None and len(good) == 1 else None
        for node in holders:
            if node != keep:
                refused.setdefault(
                    node,
                    f"client {c} is claimed by nodes {' and '.join(map(str, holders))}; "
                    "give each client's data to one node",
                )
    for node in refused:
        reports.pop(node, None)
    return n, shape


def discover(
    grid: Grid,
    experiment: str,
    seed: int,
    timeout: float | None = None,
    expected: NodeManifest | None = None,
) -> tuple[FederationInfo, dict[int, int]]:
    """Ask every connected node which clients it holds; the federation and client → node map.

    Every node's report is checked (:func:`~fedcluster.flower.verify.setup_report`).
    A node whose reply is malformed, that reports another federation size or
    data shape than the server's manifest (without one: than most nodes), that
    claims a client id outside the federation, or a client another node claims
    too, is refused: logged with the reason, left out
    (:attr:`FederationInfo.refused`), never the end of the run by itself.

    Without ``expected`` (the server's manifest of the export) every client id
    0..n−1 must then be held by exactly one node that answered (n: the federation's
    size the nodes' manifests give, else the ids reported). With it, the
    federation is the manifest's, and a client no node serves yet is unavailable
    ("no node serves it"): its node may connect later
    (:meth:`FlowerBackend.start_round`). A client its node cannot serve, or
    whose file's hash differs from ``expected``, is logged with the reason and
    kept (it will fail each request); a node that fails or does not answer is
    logged, and ends discovery with one line only when its clients are then
    missing and there is no ``expected``.
    """
    nodes = connected_nodes(grid)
    what = protocol.SETUP
    got, reports, refused = _ask_setup(grid, nodes, experiment, seed, timeout)
    claimed = {node: [c for c, _ in r.clients] for node, r in reports.items()}
    total, shape = _refuse_dissenters(reports, refused, expected)
    for node, reason in refused.items():
        log.warning("%s: node %s is refused and left out: %s", what, node, reason)
    held, unavailable = _held_clients(reports, expected)
    n = len(held) if total is None else total
    missing = sorted(set(range(n)) - set(held))
    extra = sorted(set(held) - set(range(n)))
    lost = "; ".join(
        [f"node {k}: {r}" for k, r in got.failures.items()]
        + [f"node {k} refused: {r}" for k, r in refused.items()]
    )
    if extra or shape is None or (missing and expected is None):
        raise FlowerClientError(
            f"clients {missing or extra} of 0..{n - 1} are held by no node that answered "
            f"{what} (nodes that failed: {lost or 'none'})"
        )
    if missing:
        log.warning(
            "%s: clients %s are held by no node that answered (nodes that failed: %s); "
            "they fail every request until their node connects",
            what,
            ", ".join(map(str, missing)),
            lost or "none",
        )
    if expected is not None:
        info = [expected.clients[c] for c in range(n)]
        unavailable.update({c: "no node serves it" for c in missing})
    else:
        info = [held[c][1] for c in range(n)]
    groups = np.array([-1 if i["group"] is None else int(i["group"]) for i in info])
    federation = FederationInfo(
        train_sizes=np.array([int(i["train_size"]) for i in info]),
        test_sizes=np.array([int(i["test_size"]) for i in info]),
        groups=None if (groups < 0).any() else groups,
        n_classes=shape[0],
        input_shape=shape[1],
        unavailable=dict(sorted(unavailable.items())),
        refused={
            node: ([c for c in claimed.get(node, []) if 0 <= c < n], reason)
            for node, reason in sorted(refused.items())
        },
    )
    return federation, {c: held[c][0] for c in range(n) if c in held}


def _held_clients(
    reports: dict[int, SetupReport], expected: NodeManifest | None
) -> tuple[dict[int, tuple[int, dict]], dict[int, str]]:
    """Client -> (its node, what the node reports of it), and the clients that cannot
    take part (logged with the reason: they fail every request)."""
    held: dict[int, tuple[int, dict]] = {}
    unavailable: dict[int, str] = {}
    for node, report in reports.items():
        for c, one in report.clients:
            held[c] = (node, one)
            reason = refusal(c, node, one, expected)
            if reason is not None:
                unavailable[c] = reason
                log.warning(
                    "%s: client %s (node %s) cannot take part; it is left out and fails "
                    "every request: %s",
                    protocol.SETUP,
                    c,
                    node,
                    reason,
                )
    return held, unavailable


@dataclass
class Fleet:
    """What the server knows of its nodes during one seed (shared by the seed's jobs)."""

    nodes: dict[int, int]
    """Client -> the node serving it (the latest that reported it)."""
    unavailable: dict[int, str]
    """Client -> why it is not asked (its node's setup error, a hash that differs from
    the server's manifest, no node serving it)."""
    lost: dict[int, str] = field(default_factory=dict)
    """Node -> why it is not asked (reported offline, no reply within the timeout)."""
    answered: set[int] = field(default_factory=set)
    """Nodes that answered ``query.setup`` and were not lost since."""
    seen: set[int] = field(default_factory=set)
    """Clients some node has served in this seed (a returning one has ``rejoined``)."""
    refused: dict[int, tuple[list[int], str]] = field(default_factory=dict)
    """Node -> (the federation's clients it claimed, why it is left out for the seed):
    its report failed the server's checks (:mod:`fedcluster.flower.verify`)."""
    round_trip: float = 0.0
    """The slowest round trip measured so far (seconds)."""
    probes: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Rediscovery's ``query.setup`` messages not answered yet: message id -> (node,
    when it was sent)."""
    retry: dict[int, float] = field(default_factory=dict)
    """Node -> when to ask it again (its ``query.setup`` failed)."""

    def missing(self, n_clients: int) -> dict[int, str]:
        """Client -> why it is out of reach now (unavailable, or its node lost)."""
        out = {}
        for c in range(n_clients):
            node = self.nodes.get(c)
            if c in self.unavailable:
                out[c] = self.unavailable[c]
            elif node in self.lost:
                out[c] = f"its node {node} is lost ({self.lost[node]})"
        return out


def describe_missing(missing: Mapping[int, str]) -> str:
    """``clients 6, 7 (node 4: offline); client 13 (DataError: ...)`` (one line)."""
    by_reason: dict[str, list[int]] = {}
    for c, reason in missing.items():
        by_reason.setdefault(reason, []).append(c)
    parts = []
    for reason, clients in by_reason.items():
        label = "client" if len(clients) == 1 else "clients"
        parts.append(f"{label} {', '.join(map(str, clients))} ({' '.join(reason.split())})")
    return "; ".join(parts)


class FlowerBackend(ClientClock):
    """Client computations on Flower nodes, with the simulator's interface."""

    def __init__(
        self,
        grid: Grid,
        model: nn.Module,
        federation: FederationInfo,
        fleet: Fleet,
        experiment: str,
        seed: int,
        deployment: DeploymentConfig | None = None,
        expected: NodeManifest | None = None,
    ) -> None:
        self.grid = grid
        self.fleet = fleet
        self.deployment = DeploymentConfig() if deployment is None else deployment
        self.expected = expected
        self.model = model
        self.layout = ParamLayout(model)
        self.federation = federation
        self.seed = seed
        self._experiment = experiment
        self.drifts: dict[int, list[DriftEvent]] = {}
        """Client -> the job's drift events so far: its node applies them to its own
        data before computing (every message carries its clients' events)."""
        self.asked: set[int] = set()
        """The clients asked this round (for the round's ``replies/asked`` line)."""
        self.replied: set[int] = set()
        self.round = 0
        """The round running now (for the log)."""
        self.found: list[tuple[int, str, str]] = [
            (c, "refused", f"node {node}: {reason}")
            for node, (clients, reason) in fleet.refused.items()
            for c in clients or [-1]
        ]
        """Events of clients back (or nodes refused) since the last :meth:`start_round` /
        :meth:`end_round`; the job's first round starts with the nodes refused so far
        in the seed."""

    @property
    def timeout(self) -> float:
        """Seconds a request waits: ``deployment.round_timeout`` when set, else
        ``timeout_factor`` × the slowest round trip measured so far, at least
        ``timeout_floor`` (before any is measured: ``FIRST_TIMEOUT_FLOORS`` floors) and
        at most ``timeout_ceiling``: a node answering ever slower is lost once it
        passes the ceiling instead of stretching every round."""
        d = self.deployment
        if d.round_timeout is not None:
            return d.round_timeout
        if not self.fleet.round_trip:
            return min(d.timeout_ceiling, FIRST_TIMEOUT_FLOORS * d.timeout_floor)
        measured = max(d.timeout_floor, d.timeout_factor * self.fleet.round_trip)
        return min(d.timeout_ceiling, measured)

    def _measured(self, got: Collected[int]) -> None:
        self.fleet.round_trip = max(self.fleet.round_trip, got.seconds)

    def drift(self, event: DriftEvent) -> str:
        """Record a drift event of the job (the runner calls it at the start of the
        event's round, as the simulator applies it); its description where that does
        not depend on the client's data (which only its node holds)."""
        self.drifts.setdefault(event.client, []).append(event)
        return planned_detail(event) or "two of its labels, drawn on its node"

    def start_round(self, rnd: int) -> tuple[np.ndarray, list[tuple[int, str, str]]]:
        """Rediscover the nodes at the start of round ``rnd`` (:meth:`rediscover`); the
        clients within reach (a mask: the others are not available for selection)
        and the events of the clients back since the last round's end."""
        self.asked, self.replied = set(), set()
        self.round = rnd
        self.rediscover()
        reachable = np.ones(self.federation.n_clients, dtype=bool)
        reachable[list(self.fleet.missing(self.federation.n_clients))] = False
        return reachable, self._take_events()

    def end_round(self, rnd: int) -> list[tuple[int, str, str]]:
        """The events of the clients that came back during round ``rnd`` (after its
        start, :meth:`rediscover` before each request and here): they served its
        later requests (e.g. its evaluation) and are available from the next round."""
        self.rediscover()
        return self._take_events()

    def _take_events(self) -> list[tuple[int, str, str]]:
        events, self.found = self.found, []
        return events

    def rediscover(self) -> None:
        """Ask, without waiting, each node the SuperLink lists that has not answered
        ``query.setup`` since it connected or was lost (a restarted SuperNode
        registers under a new node id), and take in the answers that have arrived.

        Called at every round start and end and before every request, so a node
        that comes back is found at the first of these after it answers, and no
        request waits for it: a node still listed but dead (the SuperLink lists a
        killed node until its heartbeat expires) costs nothing. A question not
        answered within :attr:`timeout` is asked again; a node whose
        ``query.setup`` failed is asked again after ``timeout_floor`` seconds.

        The clients of a node that answers and that were out of reach come back:
        ``rejoined`` when a node served them before in this seed (the algorithms
        keep or choose again their cluster by their own rules), ``joined`` when
        none had (newcomers). A client whose file's hash differs from the server's
        manifest stays out, with that reason.
        """
        fleet, now = self.fleet, time.monotonic()
        for mid, (node, sent) in list(fleet.probes.items()):
            if now - sent > self.timeout:
                del fleet.probes[mid]
                log.warning(
                    "round %d: node %s did not answer %s within %.1f s; asking again",
                    self.round,
                    node,
                    protocol.SETUP,
                    self.timeout,
                )
        waiting = {node for node, _ in fleet.probes.values()}
        waiting |= {node for node, when in fleet.retry.items() if when > now}
        ask = sorted(set(self.grid.get_node_ids()) - fleet.answered - waiting)
        if ask:
            ids = self.grid.push_messages(_setup_messages(ask, self._experiment, self.seed))
            for node, mid in zip(ask, ids, strict=True):
                if mid:
                    fleet.probes[str(mid)] = (node, now)
        if not fleet.probes:
            return
        for reply in self.grid.pull_messages(list(fleet.probes)):
            probe = fleet.probes.pop(str(reply.metadata.reply_to_message_id), None)
            if probe is None:
                continue
            node = probe[0]
            if reply.has_error():
                fleet.retry[node] = now + self.deployment.timeout_floor
                log.warning(
                    "round %d: node %s did not answer %s: %s",
                    self.round,
                    node,
                    protocol.SETUP,
                    " ".join(str(reply.error.reason).split()),
                )
                continue
            try:
                report = setup_report(reply.content)
            except BadReport as exc:
                self._refuse(int(node), [], str(exc))
                continue
            self._back(int(node), report)

    def _refuse(self, node: int, clients: list[int], reason: str) -> None:
        """Leave ``node`` out for the rest of the seed (its report failed the server's
        checks): logged, a ``refused`` event per client of the federation it claimed
        (client -1 when none)."""
        self.fleet.answered.add(node)
        self.fleet.refused[node] = (clients, reason)
        log.warning("round %d: node %s is refused and left out: %s", self.round, node, reason)
        self.found += [(c, "refused", f"node {node}: {reason}") for c in clients or [-1]]

    def _back(self, node: int, report: SetupReport) -> None:
        """Take in ``node``'s answer to a rediscovery: its clients' events into
        :attr:`found`. A node reporting another federation size or data shape than
        agreed at discovery is refused."""
        fleet, rnd, fed = self.fleet, self.round, self.federation
        mine = [c for c in report.ids if 0 <= c < fed.n_clients]
        if report.n_clients not in (-1, fed.n_clients):
            self._refuse(node, mine, f"it reports a federation of {report.n_clients} clients")
            return
        if report.shape not in (None, (fed.n_classes, fed.input_shape)):
            self._refuse(node, mine, f"it reports (n_classes, input_shape) {report.shape}")
            return
        for c, one in report.clients:
            if not 0 <= c < self.federation.n_clients:
                log.warning(
                    "round %d: node %s holds client %s, not in the federation", rnd, node, c
                )
                continue
            now = fleet.nodes.get(c)
            out = c in fleet.unavailable or now in fleet.lost or now is None
            if not out and now != node:
                log.warning(
                    "round %d: client %s is served by node %s; node %s holds it too and "
                    "is not asked for it",
                    rnd,
                    c,
                    now,
                    node,
                )
                continue
            fleet.nodes[c] = node
            reason = refusal(c, node, one, self.expected)
            if reason is not None:
                fleet.unavailable[c] = reason
                log.warning(
                    "round %d: client %s (node %s) cannot take part: %s", rnd, c, node, reason
                )
                continue
            fleet.unavailable.pop(c, None)
            if out:
                kind = "rejoined" if c in fleet.seen else "joined"
                self.found.append((c, kind, f"node {node}"))
                log.warning("round %d: client %s %s (node %s)", rnd, c, kind, node)
            fleet.seen.add(c)
        fleet.answered.add(node)
        fleet.lost.pop(node, None)
        fleet.retry.pop(node, None)

    def run(
        self, computation: ClientComputation, clients: np.ndarray, request: Request
    ) -> Returned:
        """One message per node for its clients among ``clients``; the replies checked
        against the computation's declared reply (:func:`assemble`).

        A client whose node fails (its error travels back), who fails on its node,
        or whose node does not answer within :attr:`timeout` is reported as failed:
        the channel treats it like the simulator's failing clients. A node the
        SuperLink reports offline (no heartbeat for 2 × its interval, 60 s by
        default) or that did not answer in time is *lost*: its clients are not
        asked again until it answers a rediscovery (:meth:`start_round`). Clients
        out of reach (a lost node's, or unavailable since setup) fail with that
        reason without being asked. The run ends with one line naming the missing
        clients and nodes (:class:`~fedcluster.flower.collect.TooFewReplies`) only
        when fewer than ``min_replies`` of the federation's clients are within
        reach, or fewer than ``min_replies`` of the clients asked on the nodes
        that answered replied.
        """
        clients = np.asarray(clients, dtype=np.int64)
        self.rediscover()
        replies, by_node = self._route(clients)
        messages = self._messages(computation, request, clients, by_node)
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
        self._measured(got)
        self._mark_lost(got, what)
        refused = self._read_replies(computation, request, clients, by_node, got, replies, what)
        self.asked.update(int(c) for c in clients)
        self.replied.update(
            int(clients[i])
            for i, r in enumerate(replies)
            if not isinstance(r, str) and i not in refused
        )
        self._check_reach(what, clients, by_node, replies, refused)
        for i in refused:
            replies[i] = None
        returned = assemble(computation, request, replies)
        for i, reason in refused.items():
            returned.failed.pop(i, None)
            returned.malformed[i] = reason
        return returned

    def run_summed(
        self, computation: ClientComputation, clients: np.ndarray, request: Request
    ) -> Summed:
        """The sum of ``computation``'s one reply field over ``clients`` by SecAgg+
        (:mod:`fedcluster.flower.secure`): each node sums its clients' replies, and the
        server receives only the sum over the nodes. The request's setting
        ``entry_bound`` bounds one client's entries (the quantization's range). A round
        needs 2 or more nodes (one node's sum would be its own); the clients of a node
        that dropped out, or that its node left out (its error), are not in the sum."""
        clients = np.asarray(clients, dtype=np.int64)
        self.rediscover()
        replies, by_node = self._route(clients)
        failed = {i: r for i, r in enumerate(replies) if isinstance(r, str)}
        (name,) = computation.reply
        total = torch.zeros(computation.reply[name].shape_for(request), dtype=torch.float64)
        counted = np.zeros(len(clients), dtype=bool)
        if len(by_node) < 2:
            why = "secure aggregation needs 2 or more nodes in a round (one node's sum is its own)"
            failed.update({i: why for positions in by_node.values() for i in positions})
            return Summed(total, counted, failed)
        contents = {
            node: secure.fit_ins(*self._node_request(computation, request, clients, positions))
            for node, positions in by_node.items()
        }
        bound = float(request.settings["entry_bound"]) * max(map(len, by_node.values()))
        with self.timed():
            got = secure.secure_sum(
                self.grid, contents, bound, int(request.settings.get("round", 0)), self.timeout
            )
        for node, positions in by_node.items():
            left_out = got.left_out.get(node)
            for j, i in enumerate(positions):
                if left_out is None:
                    failed[i] = f"node {node} dropped out of secure aggregation"
                elif j in left_out:
                    failed[i] = f"node error: {left_out[j]}"
                else:
                    counted[i] = True
        self.asked.update(int(c) for c in clients)
        self.replied.update(int(c) for c in clients[counted])
        return Summed(torch.from_numpy(got.total), counted, failed)

    def _route(
        self, clients: np.ndarray
    ) -> tuple[list[Payload | str | None], dict[int, list[int]]]:
        """Each position's reply so far (a reason for the clients out of reach, None for
        the others) and the positions to ask, by node."""
        fleet = self.fleet
        replies: list[Payload | str | None] = [None] * len(clients)
        by_node: dict[int, list[int]] = {}
        for i, c in enumerate(clients.tolist()):
            node = fleet.nodes.get(c)
            if c in fleet.unavailable:  # not asked until its node is rediscovered
                replies[i] = f"unavailable: {fleet.unavailable[c]}"
            elif node is None:
                replies[i] = "unavailable: no node serves it"
            elif node in fleet.lost:
                replies[i] = f"unavailable: its node {node} is lost ({fleet.lost[node]})"
            else:
                by_node.setdefault(node, []).append(i)
        return replies, by_node

    def _messages(
        self,
        computation: ClientComputation,
        request: Request,
        clients: np.ndarray,
        by_node: dict[int, list[int]],
    ) -> list[Message]:
        """One message per node: the request for its clients, and their drifts."""
        return [
            Message(
                protocol.request(*self._node_request(computation, request, clients, positions)),
                dst_node_id=node,
                message_type=protocol.message_type(computation.name),
            )
            for node, positions in by_node.items()
        ]

    def _node_request(
        self,
        computation: ClientComputation,
        request: Request,
        clients: np.ndarray,
        positions: list[int],
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """One node's tensors and settings: the request for its clients at ``positions``,
        the computation's name and home, and their drifts."""
        arrays, config = protocol.encode_clients(request, positions, clients[positions].tolist())
        config.update(
            experiment=self._experiment,
            seed=self.seed,
            computation=computation.name,
            computation_module=computation.module,
        )
        drifted = {int(c): self.drifts[int(c)] for c in clients[positions] if c in self.drifts}
        if drifted:
            config[protocol.DRIFT] = protocol.encode_drift(drifted)
        return arrays, config

    def _mark_lost(self, got: Collected[int], what: str) -> None:
        """The nodes offline or timed out are lost until a rediscovery finds them."""
        fleet = self.fleet
        for node in got.offline | got.timed_out:
            reason = "offline" if node in got.offline else got.failures[node]
            fleet.lost[node] = reason
            fleet.answered.discard(node)
            log.warning(
                "%s: node %s is lost; its clients (%s) are not asked until it is back: %s",
                what,
                node,
                ", ".join(str(c) for c, n in fleet.nodes.items() if n == node),
                got.failures[node],
            )

    def _read_replies(
        self,
        computation: ClientComputation,
        request: Request,
        clients: np.ndarray,
        by_node: dict[int, list[int]],
        got: Collected[int],
        replies: list[Payload | str | None],
        what: str,
    ) -> dict[int, str]:
        """Fill ``replies`` with each node's answers; the positions refused, with why (a
        malformed message, or a sample count other than the one agreed at setup)."""
        refused: dict[int, str] = {}
        for node, positions in by_node.items():
            answers: list[Payload | str] = [got.failures.get(node, "")] * len(positions)
            if node in got.replies:
                try:
                    answers = replies_of(got.replies[node].content, len(positions))
                except BadReport as exc:
                    refused.update({i: f"node {node}: {exc}" for i in positions})
            for i, answer in zip(positions, answers, strict=True):
                replies[i] = answer
                if i in refused:
                    continue
                if isinstance(answer, str) and node in got.replies:
                    log.warning("%s: client %d failed: %s", what, clients[i], answer)
                elif not isinstance(answer, str):
                    wrong = wrong_count(computation, request, i, answer, self._sizes(clients[i]))
                    if wrong:
                        refused[i] = f"node {node}: {wrong}"
        return refused

    def _check_reach(
        self,
        what: str,
        clients: np.ndarray,
        by_node: dict[int, list[int]],
        replies: list[Payload | str | None],
        refused: dict[int, str],
    ) -> None:
        """TooFewReplies when too few of the clients asked on live nodes replied, or too
        few of the federation's clients are within reach."""
        fleet = self.fleet
        live = [
            i for node, positions in by_node.items() if node not in fleet.lost for i in positions
        ]
        failures = {
            int(clients[i]): refused.get(i) or replies[i]
            for i in live
            if isinstance(replies[i], str) or i in refused
        }
        check_enough(
            what,
            len(live),
            len(live) - len(failures),
            self.deployment.min_replies,
            "; ".join(f"client {c}: {r}" for c, r in failures.items()),
        )
        n = self.federation.n_clients
        missing = fleet.missing(n)
        if required(n, self.deployment.min_replies) > n - len(missing):
            raise TooFewReplies(
                f"{what}: {n - len(missing)} of the federation's {n} clients are within reach, "
                f"{required(n, self.deployment.min_replies)} needed "
                f"(deployment.min_replies={self.deployment.min_replies:g}); missing: "
                + describe_missing(missing)
            )

    def _sizes(self, client: int) -> dict[str, int]:
        """The client's sample counts agreed at setup, by split."""
        fed = self.federation
        return {"train": int(fed.train_sizes[client]), "test": int(fed.test_sizes[client])}
