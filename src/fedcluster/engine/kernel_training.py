"""Local SGD for MLPs on groups of clients, with the hand-written kernel.

FedAvg's ClientUpdate (McMahan et al., "Communication-Efficient Learning of
Deep Networks from Decentralized Data", Alg. 1) with FedProx's proximal term
(Li et al., "Federated Optimization in Heterogeneous Networks", eq. 2) and
momentum, for ``Sequential(Flatten, Linear, ReLU, ..., Linear)`` models: groups of
clients train at once on :class:`~fedcluster.engine.mlp_kernel.MLPKernel`, each
group on a worker thread. Plain SGD defers the first layer's update over chunks
of steps (:meth:`MLPKernel.sgd_deferred`), full-batch gradient descent over all
steps (:meth:`MLPKernel.sgd_full_batch`, IFCA's setting); a given per-group
step replaces the plain one (DP-SGD's, :mod:`fedcluster.engine.dp_training`).
The results equal the client-by-client autograd path
(:mod:`fedcluster.engine.autograd_training`) to float tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from fedcluster.engine.gram import GramCache
from fedcluster.engine.hugepages import RowBlocks
from fedcluster.engine.mlp_kernel import LayerParams, MLPKernel
from fedcluster.engine.precision import float32_products_in
from fedcluster.engine.results import TrainResult
from fedcluster.engine.threads import run_on_threads
from fedcluster.engine.training_inputs import TrainingInputs
from fedcluster.protocol.batches import LocalTraining

GroupStep = Callable[
    [LayerParams, int, torch.Tensor, torch.Tensor, "LayerParams | None"], torch.Tensor
]
"""One step of a client group on the MLP kernel: ``(params, step, batch indices [G, B],
row weights [G, B], FedProx anchors) -> batch losses [G]`` (updates ``params`` in place)."""


@dataclass
class _KernelRound:
    """What every group of one MLP-kernel training call shares
    (:meth:`KernelTraining.train`): the clients' plans (or, on the full-batch route,
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


class KernelTraining:
    """Group training of MLP clients over the inputs' packed federation.

    ``group_size`` clients train together (default: as many equal groups of at
    most :data:`MAX_GROUP` clients as keep every worker busy,
    :func:`balanced_group_size`); ``low`` is the reduced precision of the matrix
    products (:mod:`fedcluster.engine.precision`), ``None`` for float32.
    """

    def __init__(
        self,
        inputs: TrainingInputs,
        kernel: MLPKernel,
        group_size: int | None,
        low: torch.dtype | None,
    ) -> None:
        self.inputs = inputs
        self.kernel = kernel
        self.group_size = group_size
        self.low = low
        fed = inputs.federation
        self.features = nonzero_span(self.inputs.x_flat)
        """The input columns the kernel reads (:func:`nonzero_span`)."""
        self.grams = GramCache(self.inputs.x_flat[:, self.features], fed.train_offsets, low=low)
        self._row_blocks = RowBlocks()  # the mini-batch routes' output, reused across rounds

    def follow_data_changes(self, changed: np.ndarray) -> None:
        """Bring the used input features and the Gram matrices up to date after
        in-place changes of the ``changed`` clients' data (drift)."""
        features = nonzero_span(self.inputs.x_flat)
        if features == self.features:
            self.grams.invalidate(changed)
        else:
            self.features = features
            self.grams = GramCache(
                self.inputs.x_flat[:, features], self.inputs.federation.train_offsets, low=self.low
            )

    def full_batch_steps(
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
        if not plain or classifier_only:
            return None
        sizes = self.inputs.federation.train_sizes[clients]
        if len(sizes) == 0 or sizes.max() > cfg.batch_size:
            return None
        per_client = cfg.epochs if cfg.steps is None else cfg.steps
        return np.where(sizes > 0, per_client, 0).astype(np.int64)

    def train(
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
        (:meth:`full_batch_steps`) takes the full-batch route without ``plans``.
        """
        kernel = self.kernel
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
            sizes=self.inputs.federation.train_sizes[clients],
            full_batch=full_batch,
            deferred=not full_batch
            and group_steps is None
            and cfg.plain_step
            and first == 0
            and deferral > 1,
            deferral=deferral,
            grams=self.grams if self.grams.suits(deferral * cfg.batch_size) else None,
            group_steps=group_steps or partial(self.plain_group_step, cfg, first),
        )
        # Clients with similar step counts share a group, so little work is padding.
        order = np.argsort(-steps.numpy(), kind="stable")
        workers = self.inputs.threads or torch.get_num_threads()
        largest = FULL_BATCH_BF16_GROUP if full_batch and self.low is not None else MAX_GROUP
        size = self.group_size or balanced_group_size(n, workers, largest)
        groups = [order[g0 : g0 + size] for g0 in range(0, n, size)]
        # the full-batch route's per-step products take bfloat16 operands inside oneDNN
        with float32_products_in(self.low if full_batch else None):
            run_on_threads(
                partial(self._train_group, shared),
                groups,
                workers,
                adaptive=self.inputs.threads is None,
            )
        return TrainResult(shared.out, shared.losses, steps)

    def plain_group_step(self, cfg: LocalTraining, first: int, members: np.ndarray) -> GroupStep:
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
            return self.kernel.sgd_step(
                params,
                self.inputs.x_flat[idx],
                self.inputs.federation.y_train[idx],
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
            idx, weight = stack_plans([r.plans[m] for m in members])
            idx = idx.to(self.inputs.device)
        weight = weight.to(self.inputs.device)
        rows = torch.as_tensor(members, device=self.inputs.device)
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
                self.features,
                same_start=start.stride(0) == 0,
                start=source,
            )
        elif r.deferred:
            assert idx is not None
            total = r.kernel.sgd_deferred(
                block,
                self.grams.samples,
                idx,
                self.inputs.federation.y_train[idx],
                weight,
                r.cfg.lr,
                r.deferral,
                self.features,
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
        total = torch.zeros(len(members), device=self.inputs.device)
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
        fed = self.inputs.federation
        off = fed.train_offsets
        idx = torch.empty(len(clients), width, dtype=torch.int64, device=self.inputs.device)
        for g, c in enumerate(np.asarray(clients).tolist()):
            lo, n = int(off[c]), int(off[c + 1] - off[c])
            idx[g] = lo
            idx[g, :n] = torch.arange(lo, lo + n, device=self.inputs.device)
        x = self.grams.samples.index_select(0, idx.view(-1)).view(len(clients), width, -1)
        keep = self.grams.suits(width)
        if keep:  # bf16: the group's missing Gram matrices in one product
            self.grams.fill(clients, x)
        gram = torch.zeros(len(clients), width, width, device=self.inputs.device)
        for g, c in enumerate(np.asarray(clients).tolist()):
            n = int(off[c + 1] - off[c])
            gram[g, :n, :n] = self.grams.client(c) if keep else self.grams.compute(c)
        return x, fed.y_train[idx], gram

    # ------------------------------------------------------- losses and grads


def nonzero_span(x: torch.Tensor) -> slice:
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


def _full_batch_weights(sizes: np.ndarray, steps: np.ndarray) -> torch.Tensor:
    """The row weights [G, S, n] of :func:`_stack_plans` for plans of whole-data batches:
    1/size on a client's rows of its steps, 0 elsewhere (S and n the group's largest)."""
    width = max(int(sizes.max(initial=0)), 1)
    rows = np.arange(width)[None, None, :] < sizes[:, None, None]
    taken = np.arange(int(steps.max(initial=0)))[None, :, None] < steps[:, None, None]
    rate = 1.0 / np.maximum(sizes, 1)[:, None, None]
    return torch.as_tensor(np.where(rows & taken, rate, 0.0), dtype=torch.float32)


def stack_plans(plans: list[list[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
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
