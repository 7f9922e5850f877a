"""Flat parameter rows (DESIGN principle 2: parameters are rows of a matrix).

A model's parameters are one flat float32 vector of length ``d``; K cluster
models are a ``[K, d]`` tensor and n client updates an ``[n, d]`` tensor, so
averaging, similarities and SVDs are plain matrix operations. ``ParamLayout``
records where each named parameter lives in the row and runs the module on any
row through ``torch.func.functional_call``. Buffers (e.g. BatchNorm running
statistics) are not federated: they stay as in the template module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call


@dataclass(frozen=True)
class ParamSlot:
    """Where one named parameter lives in the flat row."""

    name: str
    shape: tuple[int, ...]
    start: int
    stop: int


class ParamLayout:
    """The map between a module's named parameters and a flat row."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        slots: list[ParamSlot] = []
        offset = 0
        for name, param in module.named_parameters():
            slots.append(ParamSlot(name, tuple(param.shape), offset, offset + param.numel()))
            offset += param.numel()
        if offset == 0:
            raise ValueError("model has no parameters")
        self.slots = tuple(slots)
        self.dim = offset

    def flatten(self, module: nn.Module | None = None) -> torch.Tensor:
        """The module's parameters as one detached float32 row."""
        module = self.module if module is None else module
        return torch.cat(
            [p.detach().reshape(-1).to(torch.float32) for p in module.parameters()]
        ).contiguous()

    def unflatten(self, row: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views of ``row`` shaped like the module's parameters (no copy)."""
        return {s.name: row[s.start : s.stop].view(s.shape) for s in self.slots}

    def forward(self, row: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Run the template module with the parameters of ``row`` on input ``x``."""
        return functional_call(self.module, self.unflatten(row), (x,))

    def load_into(self, module: nn.Module, row: torch.Tensor) -> None:
        """Copy ``row`` into an ``nn.Module`` of the same architecture."""
        with torch.no_grad():
            for param, slot in zip(module.parameters(), self.slots, strict=True):
                param.copy_(row[slot.start : slot.stop].view(slot.shape))

    def classifier_range(self) -> slice:
        """The row range of the last linear layer (weight and bias): the classifier.

        Used by FedAvg+FT (fine-tune the classifier) and CFLGT (classifier
        gradients). It is the trailing run of parameters that belong to the
        last module holding parameters.
        """
        last_prefix = self.slots[-1].name.rpartition(".")[0]
        first = next(s for s in self.slots if s.name.rpartition(".")[0] == last_prefix)
        return slice(first.start, self.dim)


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
