"""What a client computation sees of its clients, the same on every backend.

A registered client computation (:mod:`fedcluster.protocol.computation`) runs
where the clients are: in the simulator, over the whole federation at once,
or on a Flower node, over the node's one client. It reaches them only through
the two views defined here, so the same function runs on both backends:

- :class:`ClientContext`: one client (``run_one_client``): its own data, the
  model, and the helpers that train and evaluate it;
- :class:`ClientBatch`: many clients at once (``batched_run``), the batched
  twin of the context: the same helpers for all of them in one call, each
  reaching the runner's vectorised routine directly.

Both wrap a :class:`ClientRunner`, the protocol a backend implements (the
:class:`~fedcluster.engine.simulator.Simulator`; a Flower node's one-client
simulator, :func:`fedcluster.flower.nodedata.node_simulator`). Random streams
are derived from (seed, purpose, round, client id), so a client draws the same
batches and noise on every backend and on resume.

Modelled on FedJAX's ``for_each_client`` (a client computation as small
functions the framework batches over clients).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from copy import deepcopy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import nn

from fedcluster.protocol.batches import batch_plan
from fedcluster.rng import torch_rng

if TYPE_CHECKING:
    from fedcluster.engine.flat import ParamLayout
    from fedcluster.engine.results import EvalResult, TrainResult
    from fedcluster.protocol.batches import LocalTraining


@dataclass(frozen=True)
class ClientData:
    """One client's own data, as ``run_one_client`` sees it (on a node: all it has)."""

    client: int
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    n_classes: int
    seed: int


class ClientRunner(Protocol):
    """What runs a computation: the simulator over the federation, or a Flower node's
    one-client simulator (:func:`fedcluster.flower.nodedata.node_simulator`). Positions
    ``i`` index its federation; ``client_ids[i]`` is the client's id in the run.

    A computation never calls it directly: :class:`ClientContext` and
    :class:`ClientBatch` are its public faces."""

    seed: int
    client_ids: np.ndarray
    layout: ParamLayout
    device: torch.device
    """Where the clients' data is (:mod:`fedcluster.engine.device`)."""

    @property
    def train_sizes(self) -> np.ndarray: ...

    @property
    def keeps_own_layers(self) -> bool: ...

    def personal(self, rows: torch.Tensor, i: int) -> torch.Tensor: ...

    def client_data(self, i: int) -> ClientData: ...

    def train(
        self,
        clients: np.ndarray,
        start: torch.Tensor,
        cfg: LocalTraining,
        rnd: int,
        purpose: str = "train",
        classifier_only: bool = False,
    ) -> TrainResult: ...

    def evaluate(
        self,
        clients: np.ndarray,
        rows: torch.Tensor,
        model_of_client: np.ndarray,
        split: str = "test",
    ) -> EvalResult: ...

    def evaluate_models(
        self, clients: np.ndarray, rows: torch.Tensor, split: str = "test"
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...

    def losses_and_grads(
        self,
        clients: np.ndarray,
        models: torch.Tensor,
        cfg: LocalTraining,
        rnd: int,
        purpose: str = "decide",
        with_grads: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def losses_and_gradient_products(
        self,
        clients: np.ndarray,
        models: torch.Tensor,
        directions: torch.Tensor,
        cfg: LocalTraining,
        rnd: int,
        purpose: str = "decide",
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class ClientContext:
    """What a client computation's ``run_one_client`` sees of its client.

    The same on every backend (the simulator, a Flower node), so a computation
    written against it runs on both unchanged:

    - the client's own data: :attr:`data` (and its fields ``x_train``, ``y_train``,
      ``x_test``, ``y_test``, ``n_classes``), its id :attr:`client` and the run's
      :attr:`seed`;
    - the model as a functional module: :attr:`model` (the template ``nn.Module``;
      its own parameters are not the run's), :attr:`layout` (a model is a flat
      row of ``dim`` floats), :meth:`forward` (the model of a row on inputs) and
      :meth:`module` (a copy holding a row, for code that wants an ``nn.Module``);
    - the helpers the built-in computations use, with the run's loss, batch
      plans and random streams derived from (seed, purpose, round, client):
      :meth:`train` (local SGD, DP-SGD under record-level DP), :meth:`evaluate`,
      :meth:`losses` and :meth:`losses_and_grads` (one mini-batch per decision,
      as IFCA and JGL take it), :meth:`plan` (the mini-batches of a local
      training), :meth:`generator` (a derived random stream).
    """

    runner: ClientRunner
    position: int
    """The client's position in the runner's federation (a Flower node: 0)."""

    @property
    def data(self) -> ClientData:
        return self.runner.client_data(self.position)

    @property
    def client(self) -> int:
        """The client's id in the run (names it in every random stream)."""
        return int(self.runner.client_ids[self.position])

    @property
    def seed(self) -> int:
        return self.runner.seed

    @property
    def x_train(self) -> torch.Tensor:
        return self.data.x_train

    @property
    def y_train(self) -> torch.Tensor:
        return self.data.y_train

    @property
    def x_test(self) -> torch.Tensor:
        return self.data.x_test

    @property
    def y_test(self) -> torch.Tensor:
        return self.data.y_test

    @property
    def n_classes(self) -> int:
        return self.data.n_classes

    @property
    def layout(self) -> ParamLayout:
        return self.runner.layout

    @property
    def model(self) -> nn.Module:
        return self.runner.layout.module

    @property
    def dim(self) -> int:
        return self.runner.layout.dim

    def forward(self, row: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The outputs of the model with parameters ``row`` [d] on inputs ``x``."""
        return self.layout.forward(row, x)

    def module(self, row: torch.Tensor) -> nn.Module:
        """A copy of the model holding ``row`` (a plain ``nn.Module`` to use as you like)."""
        copy = deepcopy(self.model)
        self.layout.load_into(copy, row)
        return copy

    def plan(self, cfg: LocalTraining, rnd: int, purpose: str = "train") -> list[torch.Tensor]:
        """The mini-batches of a local training for ``purpose`` in round ``rnd``, as
        index tensors into :attr:`x_train`, in visiting order (what :meth:`train` visits)."""
        return batch_plan(len(self.y_train), cfg, self.seed, purpose, rnd, self.client)

    def train(
        self,
        start: torch.Tensor,
        cfg: LocalTraining,
        rnd: int,
        purpose: str = "train",
        classifier_only: bool = False,
    ) -> tuple[torch.Tensor, float, int]:
        """Local training from ``start`` [d] (the TRAIN computation's): the trained row [d],
        mean batch loss, steps; ``classifier_only`` trains the last layer (fine-tuning)."""
        start = start.reshape(1, -1)
        result = self.runner.train(self._me, start, cfg, rnd, purpose, classifier_only)
        return result.rows[0], float(result.loss[0]), int(result.steps[0])

    def evaluate(self, row: torch.Tensor, split: str = "test") -> tuple[int, int, float]:
        """Correct predictions, sample count and summed loss of ``row`` on a split."""
        res = self.runner.evaluate(self._me, row.reshape(1, -1), np.zeros(1, np.int64), split)
        return int(res.correct[0]), int(res.count[0]), float(res.loss_sum[0])

    def losses(
        self, rows: torch.Tensor, cfg: LocalTraining, rnd: int, purpose: str = "decide"
    ) -> torch.Tensor:
        """The loss [K] of each of K models ``rows`` [K, d] on one mini-batch of the plan."""
        losses, _ = self.runner.losses_and_grads(self._me, rows, cfg, rnd, purpose, False)
        return losses[0]

    def losses_and_grads(
        self, rows: torch.Tensor, cfg: LocalTraining, rnd: int, purpose: str = "decide"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss [K] and gradient [K, d] of each model ``rows`` [K, d] on one mini-batch."""
        losses, grads = self.runner.losses_and_grads(self._me, rows, cfg, rnd, purpose, True)
        assert grads is not None
        return losses[0], grads[0]

    def generator(self, purpose: str, rnd: int) -> torch.Generator:
        """A torch generator derived from (seed, ``purpose``, ``rnd``, client): the same
        numbers on every backend and on resume."""
        return torch_rng(self.seed, purpose, rnd, self.client)

    @property
    def _me(self) -> np.ndarray:
        return np.array([self.position], dtype=np.int64)


class ClientBatch:
    """What a client computation's ``batched_run`` sees of the n clients it runs for.

    The batched twin of :class:`ClientContext`: the same helpers, for all n
    clients in one call (row ``j`` of every result is the batch's ``j``-th
    client), each a direct call of the runner's vectorised routine. On a
    Flower node the batch is the node's one client. A computation uses

    - who the clients are: ``len(batch)``, :attr:`ids` (their ids in the run),
      :attr:`seed`, :meth:`client` (client ``j``'s :class:`ClientContext`: its data
      and the one-client helpers), :attr:`train_sizes`, :meth:`train_chunks` (their
      training samples, many clients per chunk);
    - the model: :attr:`layout`, :attr:`model`, :attr:`dim`, :attr:`device`, and under FedBN
      (``model.buffers: local``) :attr:`keeps_own_layers` and :meth:`personal`;
    - the helpers: :meth:`train`, :meth:`evaluate`, :meth:`evaluate_models`,
      :meth:`losses_and_grads`, :meth:`losses_and_gradient_products` (JGL eq. 3),
      :meth:`plans` and :meth:`generator`.

    It exposes nothing else of the runner.
    """

    __slots__ = ("_runner", "positions")

    def __init__(self, runner: ClientRunner, positions: np.ndarray) -> None:
        self._runner = runner
        self.positions = np.asarray(positions, dtype=np.int64)
        """The clients' positions in the runner's federation (a Flower node: ``[0]``)."""

    def __len__(self) -> int:
        return len(self.positions)

    @property
    def ids(self) -> np.ndarray:
        """The clients' ids in the run [n] (they name them in every random stream)."""
        return self._runner.client_ids[self.positions]

    @property
    def seed(self) -> int:
        return self._runner.seed

    @property
    def layout(self) -> ParamLayout:
        return self._runner.layout

    @property
    def model(self) -> nn.Module:
        """The template ``nn.Module`` the layout's rows parameterise (its own parameters
        are not the run's)."""
        return self._runner.layout.module

    @property
    def dim(self) -> int:
        return self._runner.layout.dim

    @property
    def device(self) -> torch.device:
        """Where the clients' data is: a row used on it is moved there once."""
        return self._runner.device

    def client(self, j: int) -> ClientContext:
        """The batch's ``j``-th client as one: its data and the one-client helpers."""
        return ClientContext(self._runner, int(self.positions[j]))

    @property
    def train_sizes(self) -> np.ndarray:
        """Each client's number of training samples [n]."""
        return self._runner.train_sizes[self.positions]

    def train_chunks(
        self, members: Sequence[int], chunk_size: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The training samples of the batch's clients ``members`` (positions in the
        batch), one client after the other in stored order, in chunks of at most
        ``chunk_size`` samples: ``(x, y, owner)`` with ``owner`` [m] the batch position
        of each sample's client (a chunk spans clients: one forward pass for many)."""
        data = [(int(j), self._runner.client_data(int(self.positions[j]))) for j in members]
        starts = np.cumsum([0] + [len(d.y_train) for _, d in data])
        for lo in range(0, int(starts[-1]), chunk_size):
            hi = min(lo + chunk_size, int(starts[-1]))
            xs, ys, owner = [], [], []
            for (j, d), first, end in zip(data, starts[:-1], starts[1:], strict=True):
                a, b = max(lo, first) - first, min(hi, end) - first
                if a < b:
                    xs.append(d.x_train[a:b])
                    ys.append(d.y_train[a:b])
                    owner.append(torch.full((b - a,), j, dtype=torch.int64))
            yield torch.cat(xs), torch.cat(ys), torch.cat(owner)

    @property
    def keeps_own_layers(self) -> bool:
        """Whether each client keeps its own BatchNorm layers (FedBN, ``model.buffers:
        local``): then a received row is used as :meth:`personal` makes it."""
        return self._runner.keeps_own_layers

    def personal(self, rows: torch.Tensor, j: int) -> torch.Tensor:
        """The rows ``[..., d]`` as the ``j``-th client uses them: under FedBN with its own
        BatchNorm layers in place of the received ones (a copy), else ``rows`` itself."""
        return self._runner.personal(rows, int(self.positions[j]))

    def plans(
        self, cfg: LocalTraining, rnd: int, purpose: str = "train"
    ) -> list[list[torch.Tensor]]:
        """Each client's mini-batches of a local training (:meth:`ClientContext.plan`)."""
        return [self.client(j).plan(cfg, rnd, purpose) for j in range(len(self))]

    def generator(self, j: int, purpose: str, rnd: int) -> torch.Generator:
        """The ``j``-th client's torch generator derived from (seed, ``purpose``, ``rnd``,
        its id): the same numbers on every backend and on resume."""
        return self.client(j).generator(purpose, rnd)

    def train(
        self,
        start: torch.Tensor,
        cfg: LocalTraining,
        rnd: int,
        purpose: str = "train",
        classifier_only: bool = False,
    ) -> TrainResult:
        """Local training of every client from ``start`` ([d], or its own row: [n, d]):
        rows [n, d], mean batch loss [n], steps [n] (:meth:`ClientContext.train`)."""
        return self._runner.train(self.positions, start, cfg, rnd, purpose, classifier_only)

    def evaluate(
        self, rows: torch.Tensor, model_of_client: np.ndarray, split: str = "test"
    ) -> EvalResult:
        """Correct predictions, sample count and summed loss [n] of the model
        ``rows[model_of_client[j]]`` on the ``j``-th client's split."""
        return self._runner.evaluate(self.positions, rows, model_of_client, split)

    def evaluate_models(
        self, rows: torch.Tensor, split: str = "test"
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Correct predictions [n, K], sample count [n] and summed losses [n, K] of each
        of K models ``rows`` [K, d] on each client's split, in one pass."""
        return self._runner.evaluate_models(self.positions, rows, split)

    def losses_and_grads(
        self,
        models: torch.Tensor,
        cfg: LocalTraining,
        rnd: int,
        purpose: str = "decide",
        with_grads: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Loss [n, K] and gradient [n, K, d] (``with_grads``) of each of K models on one
        mini-batch per client: the first of its plan for ``purpose``."""
        return self._runner.losses_and_grads(self.positions, models, cfg, rnd, purpose, with_grads)

    def losses_and_gradient_products(
        self,
        models: torch.Tensor,
        directions: torch.Tensor,
        cfg: LocalTraining,
        rnd: int,
        purpose: str = "decide",
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Loss [n, K], ‖∇L‖² [n, K] and ⟨∇L, directions_k⟩ [n, K] (float64) on the
        mini-batches of :meth:`losses_and_grads`, without forming the gradients where
        the runner can (JGL eq. 3)."""
        return self._runner.losses_and_gradient_products(
            self.positions, models, directions, cfg, rnd, purpose
        )
