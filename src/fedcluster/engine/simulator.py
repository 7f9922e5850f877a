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

MLPs run through :class:`~fedcluster.engine.mlp_kernel.MLPKernel` on groups of
clients; any other ``nn.Module`` runs client by client through
``torch.func.functional_call`` on a flat row with autograd. Both follow the
same batch plan (:func:`~fedcluster.protocol.batches.batch_plan`) and equal the
plain PyTorch loop of :mod:`fedcluster.engine.reference` to float tolerance.
With ``LocalTraining.dp`` set, ``train`` runs DP-SGD (record-level local
differential privacy, :mod:`fedcluster.privacy.mechanisms`): for any model through
per-sample gradients on the autograd path, for MLPs (without momentum) on the
kernel, which clips per-sample gradients without materialising them; both
draw the same noise and agree to float tolerance.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedcluster.data.federation import Federation
from fedcluster.data.screen import clients_with
from fedcluster.engine.clock import ClientClock
from fedcluster.engine.flat import ParamLayout, broadcast_rows
from fedcluster.engine.gram import GramCache
from fedcluster.engine.hugepages import RowBlocks
from fedcluster.engine.mlp_kernel import LayerParams, MLPKernel
from fedcluster.engine.model_eval import EVAL_ROWS, chunk_stats, distinct_chunks
from fedcluster.engine.modes import LossFn, loss_or_default, training
from fedcluster.engine.precision import float32_products_in, resolve_precision
from fedcluster.engine.results import EvalResult, TrainResult
from fedcluster.engine.threads import run_on_threads
from fedcluster.errors import ConfigError, FedclusterError
from fedcluster.privacy.mechanisms import gaussian_noise, noisy_clipped_sum, per_sample_gradients
from fedcluster.protocol.batches import LocalTraining, augmenter, batch_plan
from fedcluster.protocol.client_side import ClientData
from fedcluster.protocol.computation import ClientComputation, Request, Returned
from fedcluster.rng import torch_rng

StepGradient = Callable[[torch.Tensor, torch.Tensor, slice], tuple[torch.Tensor, float]]
"""One client's step: ``(w, batch indices, trainable range) -> (gradient on the range, loss)``."""


GroupStep = Callable[
    [LayerParams, int, torch.Tensor, torch.Tensor, "LayerParams | None"], torch.Tensor
]
"""One step of a client group on the MLP kernel: ``(params, step, batch indices [G, B],
row weights [G, B], FedProx anchors) -> batch losses [G]`` (updates ``params`` in place)."""


@dataclass
class _KernelRound:
    """What every group of one MLP-kernel training call shares
    (:meth:`Simulator._train_kernel`): the clients' plans (or, on the full-batch route,
    their step counts) and start rows, the output rows and losses the groups fill,
    and the route."""

    kernel: MLPKernel
    plans: list[list[torch.Tensor]]
    clients: np.ndarray
    start: torch.Tensor
    cfg: LocalTraining
    steps: torch.Tensor
    losses: torch.Tensor
    out: torch.Tensor
    sizes: np.ndarray
    full_batch: bool
    deferred: bool
    """Plain SGD with the first layer's updates deferred over chunks of steps."""
    deferral: int
    grams: GramCache | None
    group_steps: Callable[[np.ndarray], GroupStep]


def _local_sgd(
    w: torch.Tensor,
    anchor: torch.Tensor,
    plan: list[torch.Tensor],
    step_gradient: StepGradient,
    head: slice,
    cfg: LocalTraining,
) -> float:
    """One client's SGD steps on ``w[head]`` in place, one per mini-batch of ``plan``
    (FedProx's term towards ``anchor``, heavy-ball momentum); the summed loss."""
    buf: torch.Tensor | None = None
    total = 0.0
    for idx in plan:
        g, loss = step_gradient(w, idx, head)
        if cfg.mu > 0.0:
            g = g + cfg.mu * (w[head] - anchor[head])
        if cfg.momentum > 0.0:
            buf = g.clone() if buf is None else buf.mul_(cfg.momentum).add_(g)
            g = buf
        w[head] -= cfg.lr * g
        total += loss
    return total


class Simulator(ClientClock):
    """Batched client computations over a packed federation.

    ``group_size`` clients train together on the MLP kernel (default: as
    many equal groups of at most :data:`MAX_GROUP` clients as keep every
    worker busy, :func:`balanced_group_size`); the groups run on ``threads``
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
        self._local = (
            torch.cat([torch.arange(s.start, s.stop) for s in self.layout.local_slots()])
            if local_buffers and self.layout.local_slots()
            else None
        )
        """FedBN: the row positions each client keeps (its BatchNorm layers), else ``None``."""
        self._own: dict[int, torch.Tensor] = {}
        """FedBN: client -> its own values at those positions, once it has trained."""
        self.low = resolve_precision(precision, self.device)
        if self.kernel is not None:
            self.kernel.low = self.low
        self._x_flat = federation.x_train.reshape(len(federation.x_train), -1)
        self._revisions = federation.revisions.copy()
        self._features = _nonzero_span(self._x_flat) if self.kernel is not None else slice(None)
        self._grams = GramCache(
            self._x_flat[:, self._features], federation.train_offsets, low=self.low
        )
        self._row_blocks = RowBlocks()  # the mini-batch routes' output, reused across rounds
        self._nonfinite = _nonfinite_clients(self._x_flat, federation.train_offsets)
        self._test_chunks: np.ndarray | None = None  # distinct test sets, on first use

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
        if self.kernel is None:
            return
        features = _nonzero_span(self._x_flat)
        if features == self._features:
            self._grams.invalidate(changed)
        else:
            self._features = features
            self._grams = GramCache(
                self._x_flat[:, features], self.federation.train_offsets, low=self.low
            )

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
            full_steps = self._full_batch_steps(clients, cfg, classifier_only)
            # the full-batch route reads each client's data in stored order: no plans drawn
            plans = self.plans(clients, cfg, rnd, purpose) if full_steps is None else []
            if cfg.dp is not None and self.device.type != "cpu":
                raise FedclusterError(
                    f"privacy: record-level DP-SGD runs on the CPU only, not on {self.device}"
                )
            if cfg.dp is not None and cfg.augment != "none":
                raise FedclusterError(
                    f"train.augment: {cfg.augment!r} is not supported with record-level DP-SGD"
                )
            gens = partial(self._dropout_generator, clients, rnd, purpose)
            if cfg.dp is not None:
                result = self._train_dp(plans, start, cfg, classifier_only, clients, rnd, purpose)
            elif self.kernel is not None and cfg.augment == "none":
                result = self._train_kernel(
                    plans, clients, start, cfg, classifier_only, full_steps=full_steps
                )
            else:

                def transforms(i: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
                    client = int(self.client_ids[clients[i]])
                    return augmenter(cfg, self.seed, purpose, rnd, client)

                result = self._train_autograd(
                    plans, start, cfg, classifier_only, gens, transforms=transforms
                )
            self._keep_own(clients, result.rows)
            rows, loss = result.rows.cpu(), result.loss
            poisoned = torch.as_tensor(self._nonfinite[clients])
            if poisoned.any():  # garbage in, NaN out, wherever in its inputs the NaN sits
                rows[poisoned], loss[poisoned] = math.nan, math.nan
            return TrainResult(rows, loss, result.steps)

    def _full_batch_steps(
        self, clients: np.ndarray, cfg: LocalTraining, classifier_only: bool
    ) -> np.ndarray | None:
        """Each client's step count when training takes the kernel's full-batch route
        (:meth:`MLPKernel.sgd_full_batch`: plain SGD, every batch of every plan a
        client's whole data, i.e. ``batch_size`` at least every client's size), else
        ``None``. A client of n > 0 samples then takes ``steps`` batches (``epochs``
        without ``steps``: one per epoch), each a permutation of all n samples
        (:func:`~fedcluster.protocol.batches.batch_plan`), which the route does not need.
        """
        plain = cfg.plain_step and cfg.dp is None and cfg.augment == "none"
        if self.kernel is None or not plain or classifier_only:
            return None
        sizes = self.federation.train_sizes[clients]
        if len(sizes) == 0 or sizes.max() > cfg.batch_size:
            return None
        per_client = cfg.epochs if cfg.steps is None else cfg.steps
        return np.where(sizes > 0, per_client, 0).astype(np.int64)

    def _dropout_generator(
        self, clients: np.ndarray, rnd: int, purpose: str, i: int
    ) -> torch.Generator:
        """The generator of client ``clients[i]``'s training randomness (Dropout's masks),
        derived from ``(seed, "dropout/<purpose>", round, client)``."""
        return torch_rng(self.seed, f"dropout/{purpose}", rnd, int(self.client_ids[clients[i]]))

    def _train_autograd(
        self,
        plans: list[list[torch.Tensor]],
        start: torch.Tensor,
        cfg: LocalTraining,
        classifier_only: bool,
        generators: Callable[[int], torch.Generator],
        gradients: Callable[[int], StepGradient] | None = None,
        transforms: Callable[[int], Callable[[torch.Tensor], torch.Tensor] | None] | None = None,
    ) -> TrainResult:
        """Client-by-client SGD with autograd (any model).

        ``gradients(i)`` gives client ``i``'s step gradient (DP-SGD's noisy
        clipped one); by default the plain mini-batch gradient, of the batch as
        ``transforms(i)`` augments it (``train.augment``; None: as it is). FedProx's term
        and momentum act on that gradient, which covers the trainable
        parameters only; a training-mode forward pass updates the row's float
        buffers (BatchNorm's running statistics). The module runs in
        ``train()`` with its randomness drawn from ``generators(i)``
        (:mod:`fedcluster.engine.modes`).

        Plain SGD with more than one thread runs the per-client loop on worker
        threads, each with its own copy of the module (``functional_call``
        swaps a module's parameters, so two threads must not share one) and one
        intra-op thread: batching convolutions across clients does not pay on
        a CPU, splitting a client's small convolutions across cores pays less
        than one client per core. Each client's arithmetic
        is single-threaded whichever worker runs it, so results do not depend
        on how many workers the load allows.
        """
        out = start.clone()
        losses = torch.full((len(plans),), float("nan"))
        steps = torch.zeros(len(plans), dtype=torch.int64)
        head = self.layout.classifier_range() if classifier_only else self._trainable

        def train_one(i: int, layout: ParamLayout) -> None:
            plan = plans[i]
            if gradients is None:
                transform = None if transforms is None else transforms(i)
                step_gradient: StepGradient = partial(
                    self._plain_gradient, layout=layout, transform=transform
                )
            else:
                step_gradient = gradients(i)
            w = start[i].clone()
            with training(layout.module, generators(i)):
                total = _local_sgd(w, start[i], plan, step_gradient, head, cfg)
            out[i] = w
            steps[i] = len(plan)
            if plan:
                losses[i] = total / len(plan)

        threads = self.threads or torch.get_num_threads()
        if gradients is not None or threads <= 1 or len(plans) <= 1:
            for i in range(len(plans)):
                train_one(i, self.layout)
            return TrainResult(out, losses, steps)
        local = threading.local()

        def run(group: np.ndarray) -> None:
            if not hasattr(local, "layout"):
                local.layout = ParamLayout(copy.deepcopy(self.model))
            for i in group:
                train_one(int(i), local.layout)

        # Longest plans first, one client per job, so the workers finish together.
        order = np.argsort(-np.array([len(p) for p in plans]), kind="stable")
        jobs = [order[j : j + 1] for j in range(len(order))]
        run_on_threads(run, jobs, threads, adaptive=self.threads is None)
        return TrainResult(out, losses, steps)

    def _plain_gradient(
        self,
        w: torch.Tensor,
        idx: torch.Tensor,
        head: slice,
        layout: ParamLayout | None = None,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, float]:
        """Mini-batch loss gradient at ``w`` (restricted to ``head``) and the loss, on the
        batch's inputs passed through ``transform`` if given (augmentation).

        Each parameter of ``head`` is its own autograd leaf (a detached view of
        ``w``), so the backward pass neither forms a zero-filled gradient of the
        whole row per parameter (the backward of slicing a flat leaf) nor
        computes gradients outside ``head``; the values are those of the flat leaf.
        The float buffers run on a copy that is written back into ``w`` after
        the pass (a training-mode BatchNorm updates them in place).
        """
        layout = layout or self.layout
        fed = self.federation
        idx = idx.to(self.device)
        buffers = w[layout.param_dim :].clone()
        params = {s.name: w[s.start : s.stop].view(s.shape).detach() for s in layout.slots}
        tensors = params | layout.unflatten_buffers(buffers)
        leaves = [
            params[s.name].requires_grad_()
            for s in layout.slots
            if s.start >= head.start and s.stop <= head.stop
        ]
        x = fed.x_train[idx] if transform is None else transform(fed.x_train[idx])
        logits = functional_call(layout.module, tensors, (x,))
        loss = self.loss(logits, fed.y_train[idx])
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)  # unused: gradient 0
        w[layout.param_dim :] = buffers
        flat = [
            torch.zeros(p.numel(), device=p.device) if g is None else g.reshape(-1)
            for p, g in zip(leaves, grads, strict=True)
        ]
        return torch.cat(flat), float(loss.detach())

    def _train_dp(
        self,
        plans: list[list[torch.Tensor]],
        start: torch.Tensor,
        cfg: LocalTraining,
        classifier_only: bool,
        clients: np.ndarray,
        rnd: int,
        purpose: str,
    ) -> TrainResult:
        """DP-SGD (Abadi et al. 2016, Alg. 1) for any model, client by client.

        Per-sample gradients by ``vmap(grad(...))``
        (:func:`~fedcluster.privacy.mechanisms.per_sample_gradients`), each clipped to
        ``dp.clip``, summed, plus N(0, σ²C²) noise, divided by the expected batch
        size q·n (Poisson plan) or by the batch's size (shuffled plan, where it
        is fixed: with σ = 0 and a large clip this is plain SGD).
        FedProx's term and momentum act on the privatised gradient (post-processing).
        """
        dp = cfg.dp
        assert dp is not None
        if self.kernel is not None and cfg.momentum == 0.0:
            return self._train_dp_kernel(plans, start, cfg, classifier_only, clients, rnd, purpose)
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.model.modules()):
            raise FedclusterError(
                "privacy: record-level DP-SGD needs per-sample gradients, which BatchNorm's "
                "batch statistics mix across samples; use GroupNorm or LayerNorm (as Opacus)"
            )
        fed = self.federation
        sizes = fed.train_sizes

        def gradients(i: int) -> StepGradient:
            c = int(clients[i])
            sigma = dp.sigma(c)
            gen = dp.generator(self.seed, purpose, rnd, int(self.client_ids[c]))
            expected = _expected_batch(int(sizes[c]), cfg.batch_size)

            def step(w: torch.Tensor, idx: torch.Tensor, head: slice) -> tuple[torch.Tensor, float]:
                loss = 0.0
                if len(idx):
                    x, y = fed.x_train[idx], fed.y_train[idx]
                    grads, sample_loss = per_sample_gradients(self.layout, w, x, y, self.loss)
                    grads = grads[:, head]
                    loss = float(sample_loss.mean())
                else:
                    grads = torch.zeros(0, head.stop - head.start)
                g = noisy_clipped_sum(grads, dp.clip, sigma, gen)
                return g / (expected if dp.poisson else max(1, len(idx))), loss

            return step

        gens = partial(self._dropout_generator, clients, rnd, purpose)
        return self._train_autograd(plans, start, cfg, classifier_only, gens, gradients)

    def _train_dp_kernel(
        self,
        plans: list[list[torch.Tensor]],
        start: torch.Tensor,
        cfg: LocalTraining,
        classifier_only: bool,
        clients: np.ndarray,
        rnd: int,
        purpose: str,
    ) -> TrainResult:
        """DP-SGD for MLPs on groups of clients (:meth:`MLPKernel.dp_sgd_step`).

        The same mathematics and the same noise draws as :meth:`_train_dp`
        (one N(0, I) vector over the trainable part of the row per client and
        step), without materialising per-sample gradients.
        """
        dp = cfg.dp
        kernel = self.kernel
        assert dp is not None and kernel is not None
        sizes = self.federation.train_sizes
        steps = torch.tensor([len(p) for p in plans], dtype=torch.int64)
        first = len(kernel.layers) - 1 if classifier_only else 0
        head = self.layout.classifier_range() if classifier_only else self._trainable
        width = head.stop - head.start

        def group_step(members: np.ndarray) -> GroupStep:
            ids = [int(clients[m]) for m in members]
            gens = [dp.generator(self.seed, purpose, rnd, int(self.client_ids[c])) for c in ids]
            stds = [dp.sigma(c) * dp.clip for c in ids]
            expected = [_expected_batch(int(sizes[c]), cfg.batch_size) for c in ids]

            def step(
                params: LayerParams,
                s: int,
                idx: torch.Tensor,
                weight: torch.Tensor,
                anchors: LayerParams | None,
            ) -> torch.Tensor:
                active = steps[members] > s
                noise = torch.zeros(len(members), width)
                scale = torch.zeros(len(members))
                for j in np.flatnonzero(active.numpy()):
                    noise[j] = gaussian_noise((width,), stds[j], gens[j])
                    size = len(plans[members[j]][s])
                    scale[j] = 1.0 / (expected[j] if dp.poisson else max(1, size))
                return active * kernel.dp_sgd_step(
                    params,
                    self._x_flat[idx],
                    self.federation.y_train[idx],
                    (weight > 0).to(torch.float32),
                    cfg.lr,
                    dp.clip,
                    noise,
                    scale,
                    first_trainable=first,
                    mu=cfg.mu,
                    anchors=anchors,
                )

            return step

        return self._train_kernel(plans, clients, start, cfg, classifier_only, group_step)

    def _train_kernel(
        self,
        plans: list[list[torch.Tensor]],
        clients: np.ndarray,
        start: torch.Tensor,
        cfg: LocalTraining,
        classifier_only: bool,
        group_steps: Callable[[np.ndarray], GroupStep] | None = None,
        full_steps: np.ndarray | None = None,
    ) -> TrainResult:
        """SGD on groups of clients with the MLP kernel.

        ``group_steps(members)`` gives the step of one group (DP-SGD's); by
        default plain SGD (:meth:`MLPKernel.sgd_step`). ``full_steps``
        (:meth:`_full_batch_steps`) takes the full-batch route without ``plans``.
        """
        kernel = self.kernel
        assert kernel is not None
        n = len(clients)
        if full_steps is not None:
            steps = torch.as_tensor(full_steps, dtype=torch.int64)
        else:
            steps = torch.tensor([len(p) for p in plans], dtype=torch.int64)
        first = len(kernel.layers) - 1 if classifier_only else 0
        deferral = kernel.deferral(cfg.batch_size)
        full_batch = full_steps is not None
        shared = _KernelRound(
            kernel=kernel,
            plans=plans,
            clients=clients,
            start=start,
            cfg=cfg,
            steps=steps,
            losses=torch.full((n,), float("nan")),
            # every row is written by its group; huge pages pay on the mini-batch routes
            # (fewer page faults), not on the full-batch route (measured 1.3 s slower on
            # IFCA's 1.5 GB block, docs/benchmarks.md "Roofline on AVX-512")
            out=torch.empty_like(start) if full_batch else self._row_blocks.empty_like(start),
            sizes=self.federation.train_sizes[clients],
            full_batch=full_batch,
            deferred=not full_batch
            and group_steps is None
            and cfg.plain_step
            and first == 0
            and deferral > 1,
            deferral=deferral,
            grams=self._grams if self._grams.suits(deferral * cfg.batch_size) else None,
            group_steps=group_steps or partial(self._plain_group_step, kernel, cfg, first),
        )
        # Clients with similar step counts share a group, so little work is padding.
        order = np.argsort(-steps.numpy(), kind="stable")
        workers = self.threads or torch.get_num_threads()
        largest = FULL_BATCH_BF16_GROUP if full_batch and self.low is not None else MAX_GROUP
        size = self.group_size or balanced_group_size(n, workers, largest)
        groups = [order[g0 : g0 + size] for g0 in range(0, n, size)]
        # the full-batch route's per-step products take bfloat16 operands inside oneDNN
        with float32_products_in(self.low if full_batch else None):
            run_on_threads(
                partial(self._train_group, shared), groups, workers, adaptive=self.threads is None
            )
        return TrainResult(shared.out, shared.losses, steps)

    def _plain_group_step(
        self, kernel: MLPKernel, cfg: LocalTraining, first: int, members: np.ndarray
    ) -> GroupStep:
        """The plain SGD step of one group (:meth:`MLPKernel.sgd_step`), with the
        group's own momentum buffers."""
        buffers: LayerParams | None = None

        def step(
            params: LayerParams,
            s: int,
            idx: torch.Tensor,
            weight: torch.Tensor,
            anchors: LayerParams | None,
        ) -> torch.Tensor:
            nonlocal buffers
            if cfg.momentum > 0.0 and buffers is None:
                buffers = [(torch.zeros_like(w), torch.zeros_like(b)) for w, b in params]
            return kernel.sgd_step(
                params,
                self._x_flat[idx],
                self.federation.y_train[idx],
                weight,
                cfg.lr,
                first_trainable=first,
                mu=cfg.mu,
                anchors=anchors,
                active=weight[:, 0] > 0,
                momentum=cfg.momentum,
                buffers=buffers,
            )[0]

        return step

    def _train_group(self, r: _KernelRound, members: np.ndarray) -> None:
        """Train one group's rows of ``r.out`` (in place where the members are one range
        of rows, else on a copy written back) and record their mean losses."""
        start, out = r.start, r.out
        if r.full_batch:
            idx, weight = None, _full_batch_weights(r.sizes[members], r.steps[members].numpy())
        else:
            idx, weight = _stack_plans([r.plans[m] for m in members])
            idx = idx.to(self.device)
        weight = weight.to(self.device)
        rows = torch.as_tensor(members, device=self.device)
        span = _as_range(members)
        if span is None:  # train a copy of the rows, then write it back
            block = source = start.index_select(0, rows)
        else:  # train in place in the output
            block, source = out[span], start[span]
            if not r.deferred and not r.full_batch:  # those routes write their rows
                block.copy_(source)
        if r.full_batch:  # every step on all samples: IFCA's full-batch steps
            x, y, gram = self._full_batches(r.clients[members], weight.shape[2])
            total = r.kernel.sgd_full_batch(
                block,
                x,
                y,
                weight,
                r.cfg.lr,
                gram,
                self._features,
                same_start=start.stride(0) == 0,
                start=source,
            )
        elif r.deferred:
            assert idx is not None
            total = r.kernel.sgd_deferred(
                block,
                self._grams.samples,
                idx,
                self.federation.y_train[idx],
                weight,
                r.cfg.lr,
                r.deferral,
                self._features,
                None if r.grams is None else partial(r.grams.gather, r.clients[members]),
                same_start=start.stride(0) == 0,
                start=source,
            )
        else:
            assert idx is not None
            total = self._group_steps(r, members, block, idx, weight)
        if span is None:
            out.index_copy_(0, rows, block)
        m_steps = r.steps[members]
        r.losses[members] = torch.where(
            m_steps > 0, total.cpu() / m_steps.clamp(min=1), r.losses[members]
        )

    def _group_steps(
        self,
        r: _KernelRound,
        members: np.ndarray,
        block: torch.Tensor,
        idx: torch.Tensor,
        weight: torch.Tensor,
    ) -> torch.Tensor:
        """The group's steps one at a time on ``block`` (its rows); the summed losses."""
        step = r.group_steps(members)
        params = r.kernel.unpack(block)
        anchors = r.kernel.unpack(block) if r.cfg.mu > 0.0 else None
        total = torch.zeros(len(members), device=self.device)
        for s in range(idx.shape[1]):
            total += step(params, s, idx[:, s], weight[:, s], anchors)
        r.kernel.pack(params, block)
        return total

    def _full_batches(
        self, clients: np.ndarray, width: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each client's whole training data in stored order, padded to ``width`` rows
        (padding repeats its first sample): inputs [G, width, f], labels [G, width]
        and Gram matrices [G, width, width] (zero on padding), for
        :meth:`MLPKernel.sgd_full_batch`."""
        off = self.federation.train_offsets
        idx = torch.empty(len(clients), width, dtype=torch.int64, device=self.device)
        for g, c in enumerate(np.asarray(clients).tolist()):
            lo, n = int(off[c]), int(off[c + 1] - off[c])
            idx[g] = lo
            idx[g, :n] = torch.arange(lo, lo + n, device=self.device)
        x = self._grams.samples.index_select(0, idx.view(-1)).view(len(clients), width, -1)
        keep = self._grams.suits(width)
        if keep:  # bf16: the group's missing Gram matrices in one product
            self._grams.fill(clients, x)
        gram = torch.zeros(len(clients), width, width, device=self.device)
        for g, c in enumerate(np.asarray(clients).tolist()):
            n = int(off[c + 1] - off[c])
            gram[g, :n, :n] = self._grams.client(c) if keep else self._grams.compute(c)
        return x, self.federation.y_train[idx], gram

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
            params = self.kernel.unpack(models) if self.kernel is not None else None
            if params is not None and not with_grads:  # all clients' batches at once
                return self._batch_losses(params, batches, k), None
            for i, idx in enumerate(batches):
                idx = idx.to(self.device)
                y = self.federation.y_train[idx]
                if self.kernel is not None:
                    xs, ys, weight = _replicate_batch(self._x_flat[idx], y, k)
                    losses[i], grads[i] = self.kernel.loss_and_grad(params, xs, ys, weight)
                    continue
                x = self.federation.x_train[idx]
                own = self.personal(models, clients[i])
                for j in range(k):
                    losses[i, j], g = self._loss_and_gradient(own[j], x, y, with_grads)
                    if grads is not None:
                        grads[i, j] = g
        return losses, grads

    def _batch_losses(
        self, params: LayerParams, batches: list[torch.Tensor], k: int
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
                losses[torch.as_tensor(part)] = self.kernel.batch_losses(params, x, y).T.cpu()
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
            if self.kernel is not None:
                params = self.kernel.unpack(models)
                dirs = self.kernel.unpack(directions)
            for i, idx in enumerate(batches):
                idx = idx.to(self.device)
                y = self.federation.y_train[idx]
                if self.kernel is not None:
                    xs, ys, weight = _replicate_batch(self._x_flat[idx], y, k)
                    losses[i], sq[i], dot[i] = self.kernel.loss_and_gradient_products(
                        params, dirs, xs, ys, weight
                    )
                    continue
                x = self.federation.x_train[idx]
                own = self.personal(models, clients[i])
                for j in range(k):
                    losses[i, j], g = self._loss_and_gradient(own[j], x, y, True)
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
        if kernel is not None:
            logits = partial(kernel.logits, rows)
        else:

            def logits(part: torch.Tensor) -> torch.Tensor:
                low = self.low or torch.bfloat16
                with torch.autocast(self.device.type, dtype=low, enabled=self.low is not None):
                    return torch.stack([self.layout.forward(row, part) for row in rows]).float()

        loss = None if self.loss is F.cross_entropy else self.loss
        fast = self.low is not None
        return chunk_stats(logits, rows.shape[0], x, y, off, chunks, loss, fast_softmax=fast)


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


def _nonzero_span(x: torch.Tensor) -> slice:
    """The smallest range of columns of ``x`` [N, f] outside which every value is 0.

    Handwritten digits leave pixels at the image's top and bottom black: all of
    MNIST's 60,000 training images use only pixels 12–779 of 784, the 16,000
    of the JGL round benchmark pixels 34–779. The MLP kernel skips the others.
    """
    # Only finite values count: a client's NaN must not widen the span, which would change
    # the other clients' sums (their bytes); that client's rows are NaN anyway (train).
    used = torch.nonzero(((x != 0) & torch.isfinite(x)).any(dim=0)).flatten()
    if len(used) == 0:
        return slice(0, 0)
    return slice(int(used[0]), int(used[-1]) + 1)


def _nonfinite_clients(x: torch.Tensor, offsets: np.ndarray) -> np.ndarray:
    """Per client (rows ``offsets[c]:offsets[c+1]`` of ``x``), whether an input is NaN or Inf."""
    out = np.zeros(len(offsets) - 1, dtype=bool)
    out[clients_with(~torch.isfinite(x).all(dim=1), offsets)] = True
    return out


MAX_GROUP = 8
"""The default's largest group: on JGL's MLP (docs/benchmarks.md) groups of 8
train a round fastest; larger ones are no faster."""


FULL_BATCH_BF16_GROUP = 32
"""The default's largest group on the full-batch route with bf16 products: a
step's ~45 small operators, each a few µs of Python and dispatch under the GIL,
are shared by more clients. fp32 keeps :data:`MAX_GROUP` (its numbers must not
move). Measured in docs/benchmarks.md, "bf16 products"."""


def balanced_group_size(n_clients: int, workers: int, largest: int = MAX_GROUP) -> int:
    """Group size for ``n_clients`` on ``workers`` threads: ⌊n / (w·p)⌋ with
    p = ⌈n / (w·largest)⌉ groups per worker, so groups hold at most ``largest``
    (:data:`MAX_GROUP`) clients and every worker gets at least p of them
    (80 clients on 2 threads: 10 groups of 8; 24 clients: 4 groups of 6)."""
    per_worker = max(1, math.ceil(n_clients / (workers * largest)))
    return max(1, n_clients // (workers * per_worker))


def _as_range(members: np.ndarray) -> slice | None:
    """``members`` as a slice if they are consecutive ascending integers, else ``None``."""
    first = int(members[0])
    if np.array_equal(members, np.arange(first, first + len(members))):
        return slice(first, first + len(members))
    return None


def _expected_batch(n_samples: int, batch_size: int) -> float:
    """Expected Poisson batch size q·n with q = 1/⌈n/B⌉ (the DP-SGD denominator)."""
    return n_samples / max(1, math.ceil(n_samples / batch_size))


def _replicate_batch(
    x: torch.Tensor, y: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One client's batch as a group of ``k`` identical members for the kernel."""
    weight = torch.full((k, len(y)), 1.0 / len(y), device=x.device)
    return x.unsqueeze(0).expand(k, -1, -1), y.view(1, -1).expand(k, -1), weight


def _full_batch_weights(sizes: np.ndarray, steps: np.ndarray) -> torch.Tensor:
    """The row weights [G, S, n] of :func:`_stack_plans` for plans of whole-data batches:
    1/size on a client's rows of its steps, 0 elsewhere (S and n the group's largest)."""
    width = max(int(sizes.max(initial=0)), 1)
    rows = np.arange(width)[None, None, :] < sizes[:, None, None]
    taken = np.arange(int(steps.max(initial=0)))[None, :, None] < steps[:, None, None]
    rate = 1.0 / np.maximum(sizes, 1)[:, None, None]
    return torch.as_tensor(np.where(rows & taken, rate, 0.0), dtype=torch.float32)


def _stack_plans(plans: list[list[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad plans to ``idx`` [G, S, B] and per-row weights 1/batch_size (0 = padding).

    One scatter of all batches: an assignment per batch took 0.37 ms per group
    of 4 on the round benchmark, Python run under the GIL by the worker threads."""
    n_steps = max((len(p) for p in plans), default=0)
    width = max((len(b) for p in plans for b in p), default=1)
    idx = torch.zeros(len(plans), n_steps, width, dtype=torch.int64)
    weight = torch.zeros(len(plans), n_steps, width)
    batches = [b for plan in plans for b in plan]
    if not batches:
        return idx, weight
    lengths = np.array([len(b) for b in batches])
    slots = np.array([g * n_steps + s for g, plan in enumerate(plans) for s in range(len(plan))])
    ends = np.cumsum(lengths)
    # each row's flat position: its batch's slot start plus its place in the batch
    at = np.repeat(slots * width - (ends - lengths), lengths) + np.arange(ends[-1])
    rows = torch.from_numpy(at)
    idx.view(-1)[rows] = torch.cat(batches)
    share = np.repeat(1.0 / np.maximum(lengths, 1), lengths)  # float64, as 1.0 / len(batch)
    weight.view(-1)[rows] = torch.from_numpy(share).float()
    return idx, weight
