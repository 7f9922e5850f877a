"""Flat parameter rows (DESIGN principle 2: parameters are rows of a matrix).

A model is one flat float32 vector of length ``d``; K cluster models are a
``[K, d]`` tensor and n client updates an ``[n, d]`` tensor, so averaging,
similarities and SVDs are plain matrix operations. ``ParamLayout`` records
where each named tensor lives in the row and runs the module on any row through
``torch.func.functional_call``.

The row is ``[trainable parameters | floating-point buffers]``: the first
``param_dim`` entries are the parameters, the rest the float buffers (e.g.
BatchNorm's ``running_mean`` and ``running_var``). Buffers travel with the
model, so a server averaging rows averages the running statistics with the same
weights as the parameters (as PyTorch FedAvg implementations average a
``state_dict``); SGD, gradients and the distances clustering compares act on
``row[:param_dim]`` only (:meth:`ParamLayout.params`). Integer buffers (BatchNorm's
``num_batches_tracked``, used only by ``momentum=None``) do not travel: they stay
as in the template module. Models without buffers (the MLP presets) have
``param_dim == dim``, so their rows are exactly the parameter vectors.
``local_slots`` names what FedBN (Li et al., ICLR 2021) keeps on the client:
every BatchNorm layer's statistics and affine parameters.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call


@dataclass(frozen=True)
class ParamSlot:
    """Where one named parameter or float buffer lives in the flat row."""

    name: str
    shape: tuple[int, ...]
    start: int
    stop: int


class ParamLayout:
    """The map between a module's named parameters (and float buffers) and a flat row."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.slots = _slots(module.named_parameters(), 0)
        """The trainable parameters, in ``named_parameters`` order: ``row[:param_dim]``."""
        self.param_dim = self.slots[-1].stop if self.slots else 0
        if self.param_dim == 0:
            raise ValueError("model has no parameters")
        self.buffer_slots = _slots(_float_buffers(module), self.param_dim)
        """The floating-point buffers (running statistics): ``row[param_dim:]``."""
        self.dim = self.buffer_slots[-1].stop if self.buffer_slots else self.param_dim

    def params(self, rows: torch.Tensor) -> torch.Tensor:
        """The trainable-parameter part ``[..., :param_dim]`` of rows (a view)."""
        return rows[..., : self.param_dim]

    def flatten(self, module: nn.Module | None = None) -> torch.Tensor:
        """The module's parameters and float buffers as one detached float32 row."""
        module = self.module if module is None else module
        tensors = [p for _, p in module.named_parameters()] + [b for _, b in _float_buffers(module)]
        return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors]).contiguous()

    def unflatten(self, row: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views of ``row`` shaped like the module's parameters and float buffers."""
        return {s.name: row[s.start : s.stop].view(s.shape) for s in self.slots + self.buffer_slots}

    def unflatten_buffers(self, buffers: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views of ``buffers``, a row's part ``[param_dim:]``, shaped like the buffers."""
        p = self.param_dim
        return {s.name: buffers[s.start - p : s.stop - p].view(s.shape) for s in self.buffer_slots}

    def forward(self, row: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Run the template module with the tensors of ``row`` on input ``x``, in the
        module's current mode (a training-mode BatchNorm updates the row's statistics)."""
        return functional_call(self.module, self.unflatten(row), (x,))

    def load_into(self, module: nn.Module, row: torch.Tensor) -> None:
        """Copy ``row`` into an ``nn.Module`` of the same architecture."""
        tensors = dict(module.named_parameters()) | dict(_float_buffers(module))
        with torch.no_grad():
            for slot in self.slots + self.buffer_slots:
                tensors[slot.name].copy_(row[slot.start : slot.stop].view(slot.shape))

    def local_slots(self) -> tuple[ParamSlot, ...]:
        """What FedBN keeps local: the parameters and buffers of every BatchNorm layer."""
        norms = {
            name
            for name, m in self.module.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
        }
        return tuple(
            s for s in self.slots + self.buffer_slots if s.name.rpartition(".")[0] in norms
        )

    def last_module(self) -> str:
        """The name of the last module holding parameters (the classifier; ``""``: the
        model itself)."""
        return self.slots[-1].name.rpartition(".")[0]

    def classifier_range(self) -> slice:
        """The row range of the last linear layer (weight and bias): the classifier.

        Used by FedAvg+FT (fine-tune the classifier) and CFLGT (classifier
        gradients). It is the trailing run of parameters that belong to the
        last module holding parameters.
        """
        last = self.last_module()
        first = next(s for s in self.slots if s.name.rpartition(".")[0] == last)
        return slice(first.start, self.param_dim)

    def columns(self, names: Iterable[str]) -> torch.Tensor:
        """The row positions (ascending, int64) of the named parameters and float buffers."""
        wanted = set(names)
        slots = self.slots + self.buffer_slots
        ranges = [torch.arange(s.start, s.stop) for s in slots if s.name in wanted]
        return torch.cat(ranges) if ranges else torch.empty(0, dtype=torch.int64)


def _float_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's floating-point buffers with their names (what travels in the row)."""
    return [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]


def _slots(named: Iterable[tuple[str, torch.Tensor]], offset: int) -> tuple[ParamSlot, ...]:
    """Consecutive slots for the named tensors, from ``offset`` on."""
    slots = []
    for name, tensor in named:
        slots.append(ParamSlot(name, tuple(tensor.shape), offset, offset + tensor.numel()))
        offset += tensor.numel()
    return tuple(slots)


def weighted_average(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Average of ``rows`` [n, d] with non-negative ``weights`` [n] (e.g. sample counts)."""
    w = weights.to(rows.dtype)
    return (w / w.sum()) @ rows


def broadcast_rows(rows: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """``rows`` as [n, dim]: a single row [dim] is broadcast (no copy) to every client."""
    if rows.dim() == 1:
        rows = rows.unsqueeze(0).expand(n, -1)
    if rows.shape != (n, dim):
        raise ValueError(f"expected parameter rows of shape [{n}, {dim}], got {list(rows.shape)}")
    return rows
