"""The Flower backend: the simulator's client computations sent to real nodes.

:class:`FlowerBackend` has the interface the algorithms use of
:class:`~fedcluster.engine.simulator.Simulator` (``train``,
``losses_and_grads``, ``losses_and_gradient_products``,
``gradient_trajectories``, ``evaluate``, ``federation``, ``layout``,
``seconds``), but each call becomes one Flower message per client, sent
through the ServerApp's :class:`flwr.serverapp.Grid` to the node that holds
the client (:mod:`fedcluster.flower.client`), and the replies are assembled
into the simulator's result types. The algorithms run unchanged on it
(DESIGN principle 1): what a client computes and uploads is the same, and
the server never sees client data.

The server knows the federation only through what the nodes report in
``query.setup`` (:class:`FederationInfo`): client ids, sample counts (for
sample-weighted averaging), the ground-truth group where the node knows one
(for purity), and the data shape (to build the model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import Message
from flwr.serverapp import Grid
from torch import nn

from fedcluster.engine.batches import LocalTraining
from fedcluster.engine.clock import ClientClock
from fedcluster.engine.flat import ParamLayout, broadcast_rows
from fedcluster.engine.results import EvalResult, TrainResult
from fedcluster.flower import protocol

if TYPE_CHECKING:
    from fedcluster.privacy import LocalDP


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
    by_node = {m.metadata.dst_node_id: i for i, m in enumerate(messages)}
    if len(by_node) != len(messages):
        raise ValueError("one request per node and call: a client was asked twice")
    replies: list[Message | None] = [None] * len(messages)
    for r in grid.send_and_receive(messages, timeout=timeout):
        i = by_node.get(r.metadata.src_node_id)
        if i is None:
            continue
        if r.has_error():
            raise FlowerClientError(f"{names[i]} failed: {r.error.reason}")
        replies[i] = r
    missing = [names[i] for i, r in enumerate(replies) if r is None]
    if missing:
        raise FlowerClientError(f"no reply within the timeout from {', '.join(missing)}")
    return [r for r in replies if r is not None]


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
    ) -> None:
        self.grid = grid
        self.model = model
        self.layout = ParamLayout(model)
        self.federation = federation
        self.nodes = nodes
        self.seed = seed
        self.timeout = timeout
        self._experiment = experiment

    def _ask(
        self,
        kind: str,
        clients: np.ndarray,
        arrays: list[dict[str, torch.Tensor]],
        config: dict[str, Any],
        own: list[dict[str, Any]] | None = None,
    ) -> list[dict[str, torch.Tensor]]:
        """Send request ``kind`` to each client's node (settings ``config``, plus the
        client's ``own`` ones); the reply tensors, in client order."""
        base = {"experiment": self._experiment, "seed": self.seed, **config}
        own = own or [{}] * len(clients)
        messages = [
            Message(
                protocol.request(a, {**base, **o}),
                dst_node_id=self.nodes[int(c)],
                message_type=kind,
            )
            for c, a, o in zip(clients, arrays, own, strict=True)
        ]
        with self.timed():
            replies = _receive(self.grid, messages, self.timeout, [f"client {c}" for c in clients])
        return [protocol.tensors(r.content) for r in replies]

    def train(
        self,
        clients: np.ndarray,
        start: torch.Tensor,
        cfg: LocalTraining,
        rnd: int,
        purpose: str = "train",
        classifier_only: bool = False,
        privacy: LocalDP | None = None,
    ) -> TrainResult:
        """Local SGD on each client's node from its start row (:meth:`Simulator.train`).

        Under local DP each node draws its own noise: DP-SGD's (``cfg.dp``) and,
        for an upload (``privacy``), the client-level noise, or withholds the
        upload its budget does not allow; the ledger stays on the server.
        """
        clients = np.asarray(clients, dtype=np.int64)
        rows = broadcast_rows(start, len(clients), self.layout.dim)
        config = {**protocol.training_config(cfg, rnd, purpose), "classifier_only": classifier_only}
        own: list[dict[str, Any]] = [{} for _ in clients]
        for settings, c in zip(own, clients, strict=True):
            if cfg.dp is not None:
                settings.update(protocol.client_dp_config(cfg.dp, int(c)))
            if privacy is not None:
                settings.update(protocol.ticket_config(privacy.ticket(int(c))))
        out = self._ask(protocol.TRAIN, clients, [{"start": r} for r in rows], config, own)
        return TrainResult(
            torch.stack([o["row"] for o in out]).reshape(len(clients), -1),
            torch.cat([o["loss"] for o in out]),
            torch.cat([o["steps"] for o in out]),
        )

    def losses_and_grads(
        self,
        clients: np.ndarray,
        models: torch.Tensor,
        cfg: LocalTraining,
        rnd: int,
        purpose: str = "decide",
        with_grads: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Loss [n, K] and gradient [n, K, d] of K models (:meth:`Simulator.losses_and_grads`)."""
        clients = np.asarray(clients, dtype=np.int64)
        config = {**protocol.training_config(cfg, rnd, purpose), "with_grads": with_grads}
        out = self._ask(protocol.LOSSES, clients, [{"models": models}] * len(clients), config)
        losses = torch.stack([o["losses"] for o in out]).reshape(len(clients), -1)
        if not with_grads:
            return losses, None
        return losses, torch.stack([o["grads"] for o in out])

    def losses_and_gradient_products(
        self,
        clients: np.ndarray,
        models: torch.Tensor,
        directions: torch.Tensor,
        cfg: LocalTraining,
        rnd: int,
        purpose: str = "decide",
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Loss, ‖∇L‖² and ⟨∇L, D⟩ [n, K] (:meth:`Simulator.losses_and_gradient_products`)."""
        clients = np.asarray(clients, dtype=np.int64)
        config = protocol.training_config(cfg, rnd, purpose)
        arrays = [{"models": models, "directions": directions}] * len(clients)
        out = self._ask(protocol.PRODUCTS, clients, arrays, config)
        return tuple(  # type: ignore[return-value]
            torch.stack([o[k] for o in out]).reshape(len(clients), -1)
            for k in ("losses", "sq", "dot")
        )

    def gradient_trajectories(
        self, clients: np.ndarray, row: torch.Tensor, normalise: bool = True
    ) -> torch.Tensor:
        """CFLGT's trajectories [n, C, 2] (:meth:`Simulator.gradient_trajectories`)."""
        clients = np.asarray(clients, dtype=np.int64)
        arrays = [{"start": row}] * len(clients)
        out = self._ask(protocol.TRAJECTORY, clients, arrays, {"normalise": normalise})
        return torch.stack([o["trajectory"] for o in out])

    def evaluate(
        self,
        clients: np.ndarray,
        rows: torch.Tensor,
        model_of_client: np.ndarray,
        split: str = "test",
    ) -> EvalResult:
        """Accuracy and loss of ``rows[model_of_client[i]]`` on client ``clients[i]``'s data."""
        clients = np.asarray(clients, dtype=np.int64)
        arrays = [{"model": rows[int(m)]} for m in np.asarray(model_of_client)]
        out = self._ask(protocol.EVALUATE, clients, arrays, {"split": split})
        return EvalResult(
            np.array([int(o["correct"].reshape(-1)[0]) for o in out], dtype=np.int64),
            np.array([int(o["count"].reshape(-1)[0]) for o in out], dtype=np.int64),
            np.array([float(o["loss_sum"].reshape(-1)[0]) for o in out], dtype=np.float64),
        )
