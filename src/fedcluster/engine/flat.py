"""Flat parameter rows (parameters are rows of a matrix).

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

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from fedcluster.engine.threads import run_on_threads


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
    return _normalised(weights, rows.dtype) @ rows


def _normalised(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weights`` in ``dtype``, divided by their sum: the row of :func:`weighted_average`."""
    w = weights.to(dtype)
    return w / w.sum()


SCALE_BYTES = 4 << 20
"""Bytes of the weighted rows a worker of :func:`group_averages` scales at a time
(one product for a chunk of consecutive rows); they stay in cache until added."""


def group_averages(
    rows: torch.Tensor, groups: np.ndarray, weights: torch.Tensor
) -> tuple[np.ndarray, torch.Tensor]:
    """``(names, means)``: each group's weighted mean of ``rows`` [n, d].

    ``groups`` [n] labels the rows, ``weights`` [n] weighs them; ``names`` are
    the distinct labels (ascending). ``means[i]`` is the sum, member after
    member in row order, of ``v_j * rows[j]`` with ``v`` the group's weights
    divided by their sum: every product rounded, then added to the running sum
    (no fused multiply-add). Elementwise IEEE products and sums make this the
    same bits on every CPU and GPU, whatever the thread count; on the project's
    EPYC it is also what :func:`weighted_average` (MKL's gemv) gives for the
    group's rows, so the golden files did not move when it replaced the gather.

    The rows are read once, in order, however scattered the groups are (IFCA's
    trained rows are in client order, its clusters spread over them), like the
    IFCA-style loop reads each model once (``benchmarks/performance/bench_ifca.py``). The
    columns are split between worker threads (:func:`~fedcluster.engine.threads.
    run_on_threads`); a worker scales a chunk of consecutive rows by one product
    into a cached block (:data:`SCALE_BYTES`) and adds each scaled row to its
    group's sum.
    """
    names, inverse = np.unique(groups, return_inverse=True)
    means = rows.new_zeros(len(names), rows.shape[1])
    if not len(groups):
        return names, means
    weights = weights.cpu()
    scale = torch.empty(len(groups), dtype=rows.dtype)
    for i in range(len(names)):
        members = torch.as_tensor(np.flatnonzero(inverse == i))
        scale[members] = _normalised(weights[members], rows.dtype)
    scale = scale.to(rows.device)
    owner = inverse.tolist()

    def average_columns(cols: slice) -> None:
        part, sums = rows[:, cols], means[:, cols]
        chunk = max(1, SCALE_BYTES // max(part.element_size() * part.shape[1], 1))
        block = part.new_empty(min(chunk, len(owner)), part.shape[1])
        for lo in range(0, len(owner), chunk):
            hi = min(lo + chunk, len(owner))
            scaled = torch.mul(part[lo:hi], scale[lo:hi, None], out=block[: hi - lo])
            for j in range(hi - lo):
                sums[owner[lo + j]] += scaled[j]

    workers = torch.get_num_threads() if rows.device.type == "cpu" else 1
    bounds = np.linspace(0, rows.shape[1], min(workers, rows.shape[1]) + 1).astype(int)
    run_on_threads(average_columns, [slice(a, b) for a, b in itertools.pairwise(bounds)], workers)
    return names, means


def broadcast_rows(rows: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """``rows`` as [n, dim]: a single row [dim] is broadcast (no copy) to every client."""
    if rows.dim() == 1:
        rows = rows.unsqueeze(0).expand(n, -1)
    if rows.shape != (n, dim):
        raise ValueError(f"expected parameter rows of shape [{n}, {dim}], got {list(rows.shape)}")
    return rows
