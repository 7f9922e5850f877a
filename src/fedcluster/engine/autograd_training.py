"""Local SGD for any model, client by client, with autograd.

FedAvg's ClientUpdate (McMahan et al., "Communication-Efficient Learning of
Deep Networks from Decentralized Data", Alg. 1) for any ``nn.Module``: each
client's steps run on its flat parameter row through
``torch.func.functional_call``, with FedProx's proximal term (Li et al.,
"Federated Optimization in Heterogeneous Networks", eq. 2) and heavy-ball
momentum acting on the step's gradient. The step's gradient is the plain
mini-batch gradient or one given per client (DP-SGD's noisy clipped one,
:mod:`fedcluster.engine.dp_training`). It equals the plain PyTorch loop of
:mod:`fedcluster.engine.reference` to float tolerance.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from torch.func import functional_call

from fedcluster.engine.flat import ParamLayout
from fedcluster.engine.modes import training
from fedcluster.engine.results import TrainResult
from fedcluster.engine.threads import run_on_threads
from fedcluster.engine.training_inputs import TrainingInputs
from fedcluster.protocol.batches import LocalTraining

StepGradient = Callable[[torch.Tensor, torch.Tensor, slice], tuple[torch.Tensor, float]]
"""One client's step: ``(w, batch indices, trainable range) -> (gradient on the range, loss)``."""

Transform = Callable[[torch.Tensor], torch.Tensor]
"""A batch's augmentation (``train.augment``)."""


def local_sgd(
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


class AutogradTraining:
    """Client-by-client SGD with autograd over the inputs' packed federation."""

    def __init__(self, inputs: TrainingInputs) -> None:
        self.inputs = inputs

    def train(
        self,
        plans: list[list[torch.Tensor]],
        start: torch.Tensor,
        cfg: LocalTraining,
        head: slice,
        generators: Callable[[int], torch.Generator],
        gradients: Callable[[int], StepGradient] | None = None,
        transforms: Callable[[int], Transform | None] | None = None,
    ) -> TrainResult:
        """Each client's SGD steps on ``start[i][head]``, one per batch of ``plans[i]``.

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
        layout = self.inputs.layout

        def train_one(i: int, layout: ParamLayout) -> None:
            plan = plans[i]
            if gradients is None:
                transform = None if transforms is None else transforms(i)
                step_gradient: StepGradient = partial(
                    self.plain_gradient, layout=layout, transform=transform
                )
            else:
                step_gradient = gradients(i)
            w = start[i].clone()
            with training(layout.module, generators(i)):
                total = local_sgd(w, start[i], plan, step_gradient, head, cfg)
            out[i] = w
            steps[i] = len(plan)
            if plan:
                losses[i] = total / len(plan)

        threads = self.inputs.threads or torch.get_num_threads()
        if gradients is not None or threads <= 1 or len(plans) <= 1:
            for i in range(len(plans)):
                train_one(i, layout)
            return TrainResult(out, losses, steps)
        local = threading.local()

        def run(group: np.ndarray) -> None:
            if not hasattr(local, "layout"):
                local.layout = ParamLayout(copy.deepcopy(layout.module))
            for i in group:
                train_one(int(i), local.layout)

        # Longest plans first, one client per job, so the workers finish together.
        order = np.argsort(-np.array([len(p) for p in plans]), kind="stable")
        jobs = [order[j : j + 1] for j in range(len(order))]
        run_on_threads(run, jobs, threads, adaptive=self.inputs.threads is None)
        return TrainResult(out, losses, steps)

    def plain_gradient(
        self,
        w: torch.Tensor,
        idx: torch.Tensor,
        head: slice,
        layout: ParamLayout | None = None,
        transform: Transform | None = None,
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
        layout = layout or self.inputs.layout
        fed = self.inputs.federation
        idx = idx.to(self.inputs.device)
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
        loss = self.inputs.loss(logits, fed.y_train[idx])
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)  # unused: gradient 0
        w[layout.param_dim :] = buffers
        flat = [
            torch.zeros(p.numel(), device=p.device) if g is None else g.reshape(-1)
            for p, g in zip(leaves, grads, strict=True)
        ]
        return torch.cat(flat), float(loss.detach())
