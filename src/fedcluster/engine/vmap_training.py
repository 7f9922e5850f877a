"""Local SGD for groups of clients at once, for any model, with ``torch.func``.

FedAvg's ClientUpdate (McMahan et al., "Communication-Efficient Learning of
Deep Networks from Decentralized Data", Alg. 1) with FedProx's proximal term
(Li et al., "Federated Optimization in Heterogeneous Networks", eq. 2) and
heavy-ball momentum, vectorised over clients: a group's parameter rows are
stacked, and each step's gradients of all its clients come from one
``vmap(grad_and_value(...))`` over ``functional_call`` (the client dimension
becomes a batch dimension of every operator: grouped convolutions, batched
matrix products), instead of one autograd pass per client
(:mod:`fedcluster.engine.autograd_training`).

The steps are those of the client-by-client path, so the two agree to float
rounding: the same batch plans; the same update, element by element; each
client's BatchNorm running statistics updated in its own row (the buffers travel
as batched inputs); Dropout's masks drawn from each client's own generator in
the order of the model's dropout calls, the very draws of the client-by-client
path (:mod:`fedcluster.engine.modes`); the user's loss applied to each client's
batch. Clients whose batch at a step has another size (an epoch's last batch)
take that step in their own ``vmap``.

A model whose ``forward`` draws random numbers other than dropout masks or cannot
be batched by ``torch.func`` (``.item()``, control flow on values), a training-set
augmentation, or record-level DP-SGD train client by client
(:func:`vmap_unsuitable` and the simulator's dispatch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from fedcluster.engine.modes import DropoutCall, DropoutMode, draws_randomness
from fedcluster.engine.results import TrainResult
from fedcluster.engine.training_inputs import TrainingInputs
from fedcluster.models import module_mode
from fedcluster.protocol.batches import LocalTraining

VMAP_GROUP = 32
"""Clients per ``vmap`` when ``group_size`` is not set."""

MaskCall = tuple[float, tuple[int, ...]]
"""A dropout call that draws a mask: its rate and the mask's shape."""


class _RecordDropouts(DropoutMode):
    """Records the mask-drawing dropout calls of a forward pass (their outputs are
    the inputs, unchanged) and whether anything else draws random numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[MaskCall] = []
        self.other_randomness = False

    def dropout(self, call: DropoutCall) -> torch.Tensor:
        if call.shape is not None:
            self.calls.append((call.p, call.shape))
        return call.without_mask()

    def other(self, func: Callable, args: tuple, kwargs: dict[str, Any]) -> Any:
        self.other_randomness = self.other_randomness or draws_randomness(func)
        return func(*args, **kwargs)


class _ReplayMasks(DropoutMode):
    """Applies the given masks, in order, to the forward pass's dropout calls."""

    def __init__(self, masks: list[torch.Tensor]) -> None:
        super().__init__()
        self.masks = iter(masks)

    def dropout(self, call: DropoutCall) -> torch.Tensor:
        return call.without_mask() if call.shape is None else call.apply(next(self.masks))


def _dropout_calls(
    module: nn.Module, tensors: dict[str, torch.Tensor], x: torch.Tensor
) -> _RecordDropouts:
    """The dropout calls of a training-mode forward pass of ``module`` on ``x``, run
    on copies of ``tensors`` (BatchNorm's running statistics are left as they are)."""
    record = _RecordDropouts()
    copies = {name: t.clone() for name, t in tensors.items()}
    with torch.no_grad(), module_mode(module, True), record:
        functional_call(module, copies, (x,))
    return record


def _group_gradients(
    module: nn.Module, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> Callable[..., tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """``(trained, fixed, x, y, masks) -> (gradients, losses)`` for a group of clients
    (the leading dimension of every argument): each client's loss on its batch, the
    dropout calls applying its ``masks``, differentiated w.r.t. its ``trained``
    tensors; ``fixed`` holds the others (a training-mode BatchNorm updates its buffers
    there in place)."""

    def client_loss(
        trained: dict[str, torch.Tensor],
        fixed: dict[str, torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor,
        masks: list[torch.Tensor],
    ) -> torch.Tensor:
        with _ReplayMasks(masks):
            return loss(functional_call(module, trained | fixed, (x,)), y)

    return vmap(grad_and_value(client_loss), randomness="error")


def vmap_unsuitable(
    module: nn.Module,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
) -> str | None:
    """Why ``module`` cannot train in groups under ``vmap`` (``None``: it can), from a
    trial step on the samples ``(x, y)``: a forward pass that draws random numbers other
    than dropout masks (which :class:`VmapTraining` replays per client), or one that
    ``torch.func`` cannot batch (``.item()``, control flow on values)."""
    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    record = _dropout_calls(module, {n: t.detach() for n, t in tensors.items()}, x)
    if record.other_randomness:
        return (
            "the model's forward draws random numbers other than dropout masks, which only "
            "the client-by-client path seeds per client"
        )
    params = {n: p.detach()[None] for n, p in module.named_parameters()}
    state = {n: b.detach()[None].clone() for n, b in module.named_buffers()}
    masks = [torch.ones(1, *shape, dtype=torch.bool) for _, shape in record.calls]

    try:
        with module_mode(module, True):
            _group_gradients(module, loss)(params, state, x[None], y[None], masks)
    except Exception as exc:  # noqa: BLE001 -- the model's own code: any failure is the reason
        reason = " ".join(str(exc).split())[:160]
        return f"torch.func cannot batch the model's training step ({type(exc).__name__}: {reason})"
    return None


class VmapTraining:
    """Group training of any model over the inputs' packed federation, ``group_size``
    clients per ``vmap`` (default :data:`VMAP_GROUP`)."""

    def __init__(self, inputs: TrainingInputs, group_size: int | None) -> None:
        self.inputs = inputs
        self.group_size = group_size or VMAP_GROUP
        module = inputs.layout.module
        float_buffers = {s.name for s in inputs.layout.buffer_slots}
        self._calls: dict[tuple[int, ...], list[MaskCall]] = {}
        """The dropout calls of a forward pass, by the shape of one client's batch."""
        self._fixed_buffers = {
            name: b.detach().clone()
            for name, b in module.named_buffers()
            if name not in float_buffers
        }
        """Buffers outside the row (BatchNorm's ``num_batches_tracked``): every client
        starts from the module's values, which no computation reads."""

    def train(
        self,
        plans: list[list[torch.Tensor]],
        start: torch.Tensor,
        cfg: LocalTraining,
        head: slice,
        generators: Callable[[int], torch.Generator],
    ) -> TrainResult:
        """Each client's SGD steps on ``start[i][head]``, one per batch of ``plans[i]``,
        its Dropout masks drawn from ``generators(i)``; longest plans first, in groups."""
        out = start.clone()
        losses = torch.full((len(plans),), float("nan"))
        steps = torch.tensor([len(p) for p in plans], dtype=torch.int64)
        order = np.argsort(-steps.numpy(), kind="stable")
        for g0 in range(0, len(order), self.group_size):
            members = order[g0 : g0 + self.group_size]
            gens = [generators(int(i)) for i in members]
            rows, total = self._train_group(
                [plans[i] for i in members], start[members], cfg, head, gens
            )
            out[torch.as_tensor(members)] = rows
            taken = steps[members]
            losses[members] = torch.where(taken > 0, total / taken.clamp(min=1), losses[members])
        return TrainResult(out, losses, steps)

    def _train_group(
        self,
        plans: list[list[torch.Tensor]],
        start: torch.Tensor,
        cfg: LocalTraining,
        head: slice,
        generators: list[torch.Generator],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's trained rows and summed losses: at each step, the clients that
        still have a batch, in one ``vmap`` per batch size."""
        rows = start.clone()
        momentum = torch.zeros(len(plans), head.stop - head.start, device=rows.device)
        total = torch.zeros(len(plans))
        for s in range(max((len(p) for p in plans), default=0)):
            by_size: dict[int, list[int]] = {}
            for j, plan in enumerate(plans):
                if len(plan) > s:
                    by_size.setdefault(len(plan[s]), []).append(j)
            for members in by_size.values():
                at = torch.as_tensor(members)
                idx = torch.stack([plans[j][s] for j in members]).to(self.inputs.device)
                part = rows[at]
                grads, loss = self._gradients(part, idx, head, [generators[j] for j in members])
                if cfg.mu > 0.0:
                    grads = grads + cfg.mu * (part[:, head] - start[at, head])
                if cfg.momentum > 0.0:
                    momentum[at] = momentum[at] * cfg.momentum + grads
                    grads = momentum[at]
                part[:, head] -= cfg.lr * grads
                rows[at] = part
                total[at] += loss.detach().cpu()
        return rows, total

    def _gradients(
        self,
        rows: torch.Tensor,
        idx: torch.Tensor,
        head: slice,
        generators: list[torch.Generator],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss gradients [P, head width] of the rows' models on their batches
        ``idx`` [P, B] and the losses [P]; the rows' float buffers are updated in place
        (a training-mode BatchNorm's running statistics)."""
        layout = self.inputs.layout
        fed = self.inputs.federation
        n = len(rows)
        params = {s.name: rows[:, s.start : s.stop].view(n, *s.shape) for s in layout.slots}
        trained = [s.name for s in layout.slots if s.start >= head.start and s.stop <= head.stop]
        diff = {name: params.pop(name) for name in trained}
        state = {  # separate tensors: vmap writes a BatchNorm's in-place updates into them
            s.name: rows[:, s.start : s.stop].reshape(n, *s.shape).clone()
            for s in layout.buffer_slots
        }
        updated = dict(state)
        state |= {name: b.expand(n, *b.shape).clone() for name, b in self._fixed_buffers.items()}
        x, y = fed.x_train[idx], fed.y_train[idx]
        masks = self._masks(params | diff | state, x[0], generators)
        module = layout.module
        with module_mode(module, True):
            step = _group_gradients(module, self.inputs.loss)
            grads, loss = step(diff, params | state, x, y, masks)
        for s in layout.buffer_slots:
            rows[:, s.start : s.stop] = updated[s.name].reshape(n, -1)
        flat = [grads[name].reshape(n, -1) for name in trained]
        return torch.cat(flat, dim=1) if flat else rows.new_zeros(n, 0), loss

    def _masks(
        self,
        tensors: dict[str, torch.Tensor],
        x: torch.Tensor,
        generators: list[torch.Generator],
    ) -> list[torch.Tensor]:
        """Each dropout call's masks [P, ...] of this step, client ``j``'s drawn from
        ``generators[j]`` in the order of the calls (the client-by-client draws)."""
        calls = self._calls.get(tuple(x.shape))
        if calls is None:
            first = {name: t[0] for name, t in tensors.items()}
            calls = _dropout_calls(self.inputs.layout.module, first, x).calls
            self._calls[tuple(x.shape)] = calls
        if not calls:
            return []
        drawn = [
            [DropoutCall(x, p, True, shape).draw(gen) for p, shape in calls] for gen in generators
        ]
        return [
            torch.stack([client[c] for client in drawn]).to(x.device) for c in range(len(calls))
        ]
