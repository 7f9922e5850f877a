"""The simulation backend: client computations for many clients at once.

An algorithm is server logic plus a few named client computations, which any
backend runs. This module runs those computations for a set of clients over
the packed federation data:

- ``train``: local SGD from given parameter rows (FedAvg Alg. 1 ClientUpdate,
  with FedProx's proximal term, momentum, or classifier-only fine-tuning);
- ``losses_and_grads``: loss and gradient of K given models on one mini-batch
  of each client (JGL eq. 1-3, IFCA's cluster estimate);
  ``losses_and_gradient_products`` reduces each gradient to its squared norm
  and its dot product with a direction per model (all JGL's eq. 3 needs);
- ``evaluate``: test (or train) loss and accuracy of the model each client uses.

These are the kernels behind the registered client computations
(:mod:`fedcluster.engine.client_computations`); :meth:`Simulator.run` runs any
registered computation (the Backend protocol).

The simulator is the backend: it holds the packed data, draws each client's
batch plan (:func:`~fedcluster.protocol.batches.batch_plan`), keeps FedBN's
per-client layers and dispatches training to a strategy. MLPs train on groups
of clients with the hand-written kernel
(:mod:`fedcluster.engine.kernel_training`); any other ``nn.Module`` trains client
by client with autograd (:mod:`fedcluster.engine.autograd_training`). Both equal
the plain PyTorch loop of :mod:`fedcluster.engine.reference` to float tolerance.
With ``LocalTraining.dp`` set, ``train`` runs DP-SGD (record-level local
differential privacy) with the steps of :mod:`fedcluster.engine.dp_training`.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedcluster.data.federation import Federation
from fedcluster.data.screen import clients_with
from fedcluster.engine.autograd_training import AutogradTraining, Transform
from fedcluster.engine.clock import ClientClock
from fedcluster.engine.dp_training import (
    check_per_sample_model,
    dp_group_steps,
    dp_step_gradients,
)
from fedcluster.engine.flat import ParamLayout, broadcast_rows
from fedcluster.engine.kernel_training import KernelTraining
from fedcluster.engine.mlp_kernel import LayerParams, MLPKernel
from fedcluster.engine.model_eval import EVAL_ROWS, chunk_stats, distinct_chunks
from fedcluster.engine.modes import LossFn, loss_or_default
from fedcluster.engine.precision import resolve_precision
from fedcluster.engine.results import EvalResult, TrainResult
from fedcluster.engine.training_inputs import TrainingInputs
from fedcluster.engine.vmap_training import VmapTraining, vmap_unsuitable
from fedcluster.errors import ConfigError, FedclusterError
from fedcluster.protocol.batches import LocalTraining, augmenter, batch_plan
from fedcluster.protocol.client_side import ClientData
from fedcluster.protocol.computation import ClientComputation, Request, Returned


class Simulator(ClientClock):
    """Batched client computations over a packed federation.

    ``group_size`` clients train together on the MLP kernel (default: as
    many equal groups of at most
    :data:`~fedcluster.engine.kernel_training.MAX_GROUP` clients as keep every
    worker busy); the groups run on ``threads``
    worker threads (default: ``torch.get_num_threads()``, fewer while other
    processes keep CPUs busy; an explicit ``threads`` is only capped by the CPUs
    of the affinity mask; results never depend on how many start).
    ``client_ids`` names the federation's clients in the random streams (batch
    plans, DP noise); by default client i is i. A Flower node holding one
    client of a larger federation passes that client's id, so its batches are
    those the simulator draws for it. ``precision="bf16"`` runs the matrix products of
    training (MLP kernel), the K-model losses and the evaluation in bfloat16
    (:mod:`fedcluster.engine.precision`).
    """

    def __init__(
        self,
        model: nn.Module,
        federation: Federation,
        seed: int,
        group_size: int | None = None,
        use_kernel: bool = True,
        threads: int | None = None,
        client_ids: np.ndarray | None = None,
        loss: LossFn | None = None,
        local_buffers: bool = False,
        precision: str = "fp32",
        vmap: str = "auto",
    ) -> None:
        self.device = federation.x_train.device  # set by Federation.to (engine.device)
        self.model = model.to(self.device).eval()  # train() only inside local training
        _check_norm_layers(model)
        self.federation = federation
        if client_ids is not None and len(client_ids) != federation.n_clients:
            raise ValueError(
                f"client_ids: {len(client_ids)} ids for {federation.n_clients} clients"
            )
        self.client_ids = (
            np.arange(federation.n_clients) if client_ids is None else np.asarray(client_ids)
        )
        self.layout = ParamLayout(model)
        self._trainable = slice(0, self.layout.param_dim)
        self.seed = seed
        self.group_size = None if group_size is None else max(1, int(group_size))
        self.threads = threads
        self.loss = loss_or_default(loss)
        # the kernel's gradients are softmax cross-entropy's: another loss runs on autograd
        use_kernel = use_kernel and loss is None and not self.layout.buffer_slots
        self.kernel = MLPKernel.detect(model, self.layout) if use_kernel else None
        self._local = _local_positions(self.layout) if local_buffers else None
        """FedBN: the row positions each client keeps (its BatchNorm layers), else ``None``."""
        self._own: dict[int, torch.Tensor] = {}
        """FedBN: client -> its own values at those positions, once it has trained."""
        self.low = resolve_precision(precision, self.device)
        if self.kernel is not None:
            self.kernel.low = self.low
        self._x_flat = federation.x_train.reshape(len(federation.x_train), -1)
        self._revisions = federation.revisions.copy()
        self._nonfinite = _nonfinite_clients(self._x_flat, federation.train_offsets)
        self._test_chunks: np.ndarray | None = None  # distinct test sets, on first use
        inputs = TrainingInputs(
            federation, self._x_flat, self.layout, self.loss, seed, self.client_ids, threads
        )
        self.autograd_training = AutogradTraining(inputs)
        """Client-by-client training of any model (:mod:`fedcluster.engine.autograd_training`)."""
        self.kernel_training = (
            None
            if self.kernel is None
            else KernelTraining(inputs, self.kernel, self.group_size, self.low)
        )
        """Group training of MLPs (:mod:`fedcluster.engine.kernel_training`), else ``None``."""
        self.vmap_training = VmapTraining(inputs, self.group_size) if self._vmaps(vmap) else None
        """Group training of other models (:mod:`fedcluster.engine.vmap_training`), else
        ``None`` (client by client)."""

    def _vmaps(self, vmap: str) -> bool:
        """Whether models the kernel does not take train in groups with ``torch.func``:
        ``vmap="on"``, or ``"auto"`` on a GPU (on a CPU, batching convolutions across
        clients does not pay: docs/benchmarks.md, "Any model in groups")."""
        if vmap not in ("auto", "on", "off"):
            raise ConfigError(f"vmap: {vmap!r} is not one of auto, on, off")
        if self.kernel is not None or vmap == "off":
            return False
        if vmap == "auto" and self.device.type == "cpu":
            return False
        fed = self.federation
        reason = vmap_unsuitable(self.model, self.loss, fed.x_train[:2], fed.y_train[:2])
        if reason is not None and vmap == "on":
            raise ConfigError(f"vmap: on, but {reason}; set vmap: off")
        return reason is None

    def _follow_data_changes(self) -> None:
        """Bring what the simulator derives from the clients' data (which clients hold
        non-finite training inputs, the distinct test sets; for the kernel the used
        input features and the Gram matrices) up to date after in-place changes (drift)."""
        changed = np.flatnonzero(self.federation.revisions != self._revisions)
        if len(changed) == 0:
            return
        self._revisions = self.federation.revisions.copy()
        self._nonfinite = _nonfinite_clients(self._x_flat, self.federation.train_offsets)
        self._test_chunks = None
        if self.kernel_training is not None:
            self.kernel_training.follow_data_changes(changed)

    def plans(
        self, clients: np.ndarray, cfg: LocalTraining, rnd: int, purpose: str
    ) -> list[list[torch.Tensor]]:
        """Each client's mini-batch plan, as global row indices into the packed train split."""
        sizes = self.federation.train_sizes
        offsets = self.federation.train_offsets
        return [
            [
                b + int(offsets[c])
                for b in batch_plan(
                    int(sizes[c]), cfg, self.seed, purpose, rnd, int(self.client_ids[c])
                )
            ]
            for c in clients
        ]

    # ------------------------------------------------- any client computation
    def run(
        self, computation: ClientComputation, clients: np.ndarray, request: Request
    ) -> Returned:
        """Run a registered client computation for ``clients`` (the Backend protocol):
        its batched form if it has one, else client by client."""
        clients = np.asarray(clients, dtype=np.int64)
        with self.timed():
            fields = computation.run(self, clients, request)
        # The server keeps its rows on the CPU (engine.device): replies cross back here.
        fields = {name: value.cpu() for name, value in fields.items()}
        return Returned(fields, np.ones(len(clients), dtype=bool))

    def client_data(self, i: int) -> ClientData:
        """Client ``i``'s own data, for a computation run client by client."""
        fed = self.federation
        train, test = fed.client_slice(i, "train"), fed.client_slice(i, "test")
        return ClientData(
            client=int(self.client_ids[i]),
            x_train=fed.x_train[train],
            y_train=fed.y_train[train],
            x_test=fed.x_test[test],
            y_test=fed.y_test[test],
            n_classes=fed.n_classes,
            seed=self.seed,
        )

    @property
    def train_sizes(self) -> np.ndarray:
        """Each client's number of training samples."""
        return self.federation.train_sizes

    @property
    def keeps_own_layers(self) -> bool:
        """Whether clients keep their own BatchNorm layers (FedBN, ``model.buffers: local``)."""
        return self._local is not None

    def personal(self, rows: torch.Tensor, i: int) -> torch.Tensor:
        """The rows ``[..., d]`` as client ``i`` uses them: under FedBN with its own
        BatchNorm layers in place of the received ones (a copy), else ``rows`` itself."""
        own = self._own.get(int(i)) if self._local is not None else None
        if own is None:
            return rows
        rows = rows.clone()
        rows[..., self._local] = own.to(rows.device)
        return rows

    def _keep_own(self, clients: np.ndarray, rows: torch.Tensor) -> None:
        """FedBN: each client keeps the BatchNorm layers of its trained row."""
        if self._local is not None:
            for i, c in enumerate(clients):
                self._own[int(c)] = rows[i, self._local].detach().cpu().clone()

    # ------------------------------------------------------------------ train
    def train(
        self,
        clients: np.ndarray,
        start: torch.Tensor,
        cfg: LocalTraining,
        rnd: int,
        purpose: str = "train",
        classifier_only: bool = False,
    ) -> TrainResult:
        """Local SGD for each client from its start row (FedAvg's ClientUpdate).

        ``start`` is [n, d] (or [d], broadcast). FedProx's anchor is the start row.
        Local DP of the upload is the computation's release (:mod:`fedcluster.privacy.mechanisms`).
        """
        clients = np.asarray(clients, dtype=np.int64)
        cfg = cfg.at_round(rnd)
        start = broadcast_rows(start, len(clients), self.layout.dim).to(self.device)
        if self._local is not None:
            start = torch.stack([self.personal(start[i], c) for i, c in enumerate(clients)])
        with self.timed():
            self._follow_data_changes()
            result = self._train_rows(clients, start, cfg, rnd, purpose, classifier_only)
            self._keep_own(clients, result.rows)
            rows, loss = result.rows.cpu(), result.loss
            poisoned = torch.as_tensor(self._nonfinite[clients])
            if poisoned.any():  # garbage in, NaN out, wherever in its inputs the NaN sits
                rows[poisoned], loss[poisoned] = math.nan, math.nan
            return TrainResult(rows, loss, result.steps)

    def _train_rows(
        self,
        clients: np.ndarray,
        start: torch.Tensor,
        cfg: LocalTraining,
        rnd: int,
        purpose: str,
        classifier_only: bool,
    ) -> TrainResult:
        """The training strategy for this call: DP-SGD (on the kernel for MLPs without
        momentum), the kernel's group training for MLPs, else client by client."""
        kernel = self.kernel_training
        full_steps = (
            None if kernel is None else kernel.full_batch_steps(clients, cfg, classifier_only)
        )
        # the full-batch route reads each client's data in stored order: no plans drawn
        plans = self.plans(clients, cfg, rnd, purpose) if full_steps is None else []
        head = self.layout.classifier_range() if classifier_only else self._trainable
        gens = partial(self.autograd_training.inputs.dropout_generator, clients, rnd, purpose)
        if cfg.dp is not None:
            self._check_dp(cfg)
            if kernel is not None and cfg.momentum == 0.0:
                first = len(kernel.kernel.layers) - 1 if classifier_only else 0
                steps = dp_group_steps(
                    kernel, cfg.dp, plans, clients, cfg, head, first, rnd, purpose
                )
                return kernel.train(plans, clients, start, cfg, classifier_only, steps)
            check_per_sample_model(self.model)
            inputs = self.autograd_training.inputs
            gradients = dp_step_gradients(inputs, cfg.dp, cfg, clients, rnd, purpose)
            return self.autograd_training.train(plans, start, cfg, head, gens, gradients)
        if kernel is not None and cfg.augment == "none":
            return kernel.train(plans, clients, start, cfg, classifier_only, full_steps=full_steps)
        if self.vmap_training is not None and cfg.augment == "none":
            return self.vmap_training.train(plans, start, cfg, head, gens)

        def transforms(i: int) -> Transform | None:
            client = int(self.client_ids[clients[i]])
            return augmenter(cfg, self.seed, purpose, rnd, client)

        return self.autograd_training.train(plans, start, cfg, head, gens, transforms=transforms)

    def _check_dp(self, cfg: LocalTraining) -> None:
        """Record-level DP-SGD runs on the CPU and without augmentation."""
        if self.device.type != "cpu":
            raise FedclusterError(
                f"privacy: record-level DP-SGD runs on the CPU only, not on {self.device}"
            )
        if cfg.augment != "none":
            raise FedclusterError(
                f"train.augment: {cfg.augment!r} is not supported with record-level DP-SGD"
            )

    # ------------------------------------------------------- losses and grads
    def losses_and_grads(
        self,
        clients: np.ndarray,
        models: torch.Tensor,
        cfg: LocalTraining,
        rnd: int,
        purpose: str = "decide",
        with_grads: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Loss [n, K] and gradient [n, K, d] of each of K models on one mini-batch per client.

        The mini-batch is the first batch of the client's plan for ``purpose``
        (JGL Sec. II-B: one mini-batch per decision). ``with_grads=False``
        skips the backward pass (IFCA needs losses only).
        """
        clients = np.asarray(clients, dtype=np.int64)
        k = models.shape[0]
        with self.timed():
            batches = self._decision_batches(clients, cfg, rnd, purpose)
            losses = torch.empty(len(clients), k)
            grads = torch.empty(len(clients), k, self.layout.dim) if with_grads else None
            models = models.to(self.device)
            kernel = self.kernel
            if kernel is not None:
                params = kernel.unpack(models)
                if not with_grads:  # all clients' batches at once
                    return self._batch_losses(kernel, params, batches, k), None
            for i, idx in enumerate(batches):
                idx = idx.to(self.device)
                y = self.federation.y_train[idx]
                if kernel is not None:
                    xs, ys, weight = _replicate_batch(self._x_flat[idx], y, k)
                    losses[i], grad = kernel.loss_and_grad(params, xs, ys, weight)
                    if grads is not None:
                        grads[i] = grad
                    continue
                x = self.federation.x_train[idx]
                own = self.personal(models, clients[i])
                for j in range(k):
                    losses[i, j], g = self._loss_and_gradient(own[j], x, y, with_grads)
                    if grads is not None and g is not None:
                        grads[i, j] = g
        return losses, grads

    def _batch_losses(
        self, kernel: MLPKernel, params: LayerParams, batches: list[torch.Tensor], k: int
    ) -> torch.Tensor:
        """Loss [n, K] of the K models on each client's batch through the kernel: the
        clients whose batches have one size run together (:meth:`MLPKernel.batch_losses`),
        :data:`~fedcluster.engine.model_eval.EVAL_ROWS` // K rows per model and pass."""
        losses = torch.empty(len(batches), k)
        sizes = np.array([len(b) for b in batches], dtype=np.int64)
        for size in np.unique(sizes):
            members = np.flatnonzero(sizes == size)
            step = max(1, EVAL_ROWS // (k * int(size)))
            for s in range(0, len(members), step):
                part = members[s : s + step]
                idx = torch.stack([batches[i] for i in part]).to(self.device)
                x = self._x_flat[idx.view(-1)].view(len(part), int(size), -1)
                y = self.federation.y_train[idx]
                losses[torch.as_tensor(part)] = kernel.batch_losses(params, x, y).T.cpu()
        return losses

    def losses_and_gradient_products(
        self,
        clients: np.ndarray,
        models: torch.Tensor,
        directions: torch.Tensor,
        cfg: LocalTraining,
        rnd: int,
        purpose: str = "decide",
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Loss L [n, K], ‖∇L‖² [n, K] and ⟨∇L, directions_k⟩ [n, K] on one mini-batch per client.

        The same batches and gradients as :meth:`losses_and_grads`, reduced to
        the two numbers JGL's similarity (eq. 3) needs; the MLP kernel never
        forms the [n, K, d] gradients (:meth:`MLPKernel.loss_and_gradient_products`).
        Products are float64.
        """
        clients = np.asarray(clients, dtype=np.int64)
        k = models.shape[0]
        with self.timed():
            batches = self._decision_batches(clients, cfg, rnd, purpose)
            losses = torch.empty(len(clients), k)
            sq = torch.empty(len(clients), k, dtype=torch.float64)
            dot = torch.empty(len(clients), k, dtype=torch.float64)
            models, directions = models.to(self.device), directions.to(self.device)
            kernel = self.kernel
            if kernel is not None:
                params = kernel.unpack(models)
                dirs = kernel.unpack(directions)
            for i, idx in enumerate(batches):
                idx = idx.to(self.device)
                y = self.federation.y_train[idx]
                if kernel is not None:
                    xs, ys, weight = _replicate_batch(self._x_flat[idx], y, k)
                    losses[i], sq[i], dot[i] = kernel.loss_and_gradient_products(
                        params, dirs, xs, ys, weight
                    )
                    continue
                x = self.federation.x_train[idx]
                own = self.personal(models, clients[i])
                for j in range(k):
                    losses[i, j], g = self._loss_and_gradient(own[j], x, y, True)
                    assert g is not None
                    g = g.double()
                    sq[i, j], dot[i, j] = g.dot(g), g.dot(directions[j].double())
        return losses, sq, dot

    def _decision_batches(
        self, clients: np.ndarray, cfg: LocalTraining, rnd: int, purpose: str
    ) -> list[torch.Tensor]:
        """The first batch of each client's plan for ``purpose`` (one mini-batch per decision)."""
        one_batch = LocalTraining(lr=cfg.lr, batch_size=cfg.batch_size, steps=1)
        return [p[0] for p in self.plans(clients, one_batch, rnd, purpose)]

    def _loss_and_gradient(
        self, row: torch.Tensor, x: torch.Tensor, y: torch.Tensor, with_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mean loss of the model ``row`` on (x, y) in evaluation mode and, if asked, its
        gradient: with respect to the trainable parameters, 0 on the float buffers."""
        pd = self.layout.param_dim
        w = row[:pd].clone().requires_grad_(with_grad)
        loss = self.loss(self.layout.forward(torch.cat([w, row[pd:]]), x), y)
        if not with_grad:
            return loss.detach(), None
        grad = torch.autograd.grad(loss, w)[0]
        return loss.detach(), torch.cat([grad, torch.zeros_like(row[pd:])])

    # --------------------------------------------------------------- evaluate
    @torch.no_grad()
    def evaluate(
        self,
        clients: np.ndarray,
        rows: torch.Tensor,
        model_of_client: np.ndarray,
        split: str = "test",
    ) -> EvalResult:
        """Accuracy and loss of ``rows[model_of_client[i]]`` on client ``clients[i]``'s data.

        Each distinct (data set, model) pair is computed once and its result
        given to every client that shares it (:mod:`fedcluster.engine.model_eval`).
        """
        clients = np.asarray(clients, dtype=np.int64)
        model_of_client = np.asarray(model_of_client, dtype=np.int64)
        with self.timed():
            chunk, count = self._chunks(clients, split)
            correct = np.zeros(len(clients), dtype=np.int64)
            loss_sum = np.zeros(len(clients), dtype=np.float64)
            if self._local is None:  # clients sharing a model are evaluated together
                units = [
                    (rows[m : m + 1], np.flatnonzero(model_of_client == m))
                    for m in np.unique(model_of_client)
                ]
            else:  # FedBN: each client with its own BatchNorm layers
                units = [
                    (self.personal(rows[m], c).unsqueeze(0), np.array([i]))
                    for i, (c, m) in enumerate(zip(clients, model_of_client, strict=True))
                ]
            for row, members in units:
                distinct, inverse = np.unique(chunk[members], return_inverse=True)
                hits, losses = self._chunk_stats(row, distinct, split)
                correct[members] = hits[inverse, 0]
                loss_sum[members] = losses[inverse, 0]
        return EvalResult(correct, count, loss_sum)

    @torch.no_grad()
    def evaluate_models(
        self, clients: np.ndarray, rows: torch.Tensor, split: str = "test"
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Correct predictions [n, K], sample counts [n] and summed losses [n, K] of
        every model of ``rows`` [K, d] on each client's data: one pass over each
        distinct data set for all K models (IFCA's full-data choice and its
        own-loss test protocol)."""
        clients = np.asarray(clients, dtype=np.int64)
        with self.timed():
            chunk, count = self._chunks(clients, split)
            distinct, inverse = np.unique(chunk, return_inverse=True)
            hits, losses = self._chunk_stats(rows, distinct, split)
        return hits[inverse], count, losses[inverse]

    def _chunks(self, clients: np.ndarray, split: str) -> tuple[np.ndarray, np.ndarray]:
        """The data set each client evaluates on, named by the first client holding
        an equal one (test split; training sets are each client's own), and its size."""
        fed = self.federation
        off = fed.test_offsets if split == "test" else fed.train_offsets
        count = (off[clients + 1] - off[clients]).astype(np.int64)
        if split != "test":
            return clients, count
        self._follow_data_changes()
        if self._test_chunks is None:
            self._test_chunks = distinct_chunks(fed.x_test, fed.y_test, fed.test_offsets)
        return self._test_chunks[clients], count

    def _chunk_stats(
        self, rows: torch.Tensor, chunks: np.ndarray, split: str
    ) -> tuple[np.ndarray, np.ndarray]:
        """Correct counts and loss sums [len(chunks), K] of the K models ``rows`` on the
        data sets of clients ``chunks`` (:func:`~fedcluster.engine.model_eval.chunk_stats`)."""
        fed = self.federation
        x, y = (fed.x_test, fed.y_test) if split == "test" else (fed.x_train, fed.y_train)
        off = fed.test_offsets if split == "test" else fed.train_offsets
        rows = rows.to(self.device)
        kernel = self.kernel

        def logits(part: torch.Tensor) -> torch.Tensor:
            if kernel is not None:
                return kernel.logits(rows, part)
            low = self.low or torch.bfloat16
            with torch.autocast(self.device.type, dtype=low, enabled=self.low is not None):
                return torch.stack([self.layout.forward(row, part) for row in rows]).float()

        loss = None if self.loss is F.cross_entropy else self.loss
        fast = self.low is not None
        return chunk_stats(logits, rows.shape[0], x, y, off, chunks, loss, fast_softmax=fast)


def _local_positions(layout: ParamLayout) -> torch.Tensor | None:
    """The row positions of the model's BatchNorm layers (FedBN's), ``None`` if it has none."""
    slots = layout.local_slots()
    return torch.cat([torch.arange(s.start, s.stop) for s in slots]) if slots else None


def _check_norm_layers(model: nn.Module) -> None:
    """BatchNorm with ``momentum=None`` averages with ``num_batches_tracked``, an
    integer buffer that does not travel in the row (:mod:`fedcluster.engine.flat`)."""
    for name, m in model.named_modules():
        norm = isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
        if norm and m.momentum is None:
            raise ConfigError(
                f"model: {name or 'the model'} is a BatchNorm with momentum=None, whose "
                "cumulative average needs num_batches_tracked, which is not federated; "
                "give it a momentum (PyTorch's default is 0.1)"
            )


def _nonfinite_clients(x: torch.Tensor, offsets: np.ndarray) -> np.ndarray:
    """Per client (rows ``offsets[c]:offsets[c+1]`` of ``x``), whether an input is NaN or Inf."""
    out = np.zeros(len(offsets) - 1, dtype=bool)
    out[clients_with(~torch.isfinite(x).all(dim=1), offsets)] = True
    return out


def _replicate_batch(
    x: torch.Tensor, y: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One client's batch as a group of ``k`` identical members for the kernel."""
    weight = torch.full((k, len(y)), 1.0 / len(y), device=x.device)
    return x.unsqueeze(0).expand(k, -1, -1), y.view(1, -1).expand(k, -1), weight
