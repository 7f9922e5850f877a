"""What the soft-clustering methods compute on a client: per-sample losses of several
models, and local SGD with per-sample weights and a proximal anchor.

Used by FedEM (:mod:`fedcluster.algorithms.fedem`: the E-step's per-sample
likelihoods, each component trained with the responsibility-weighted loss) and
FedSoft (:mod:`fedcluster.algorithms.fedsoft`: which cluster model fits each
sample best, the proximal term toward the mixture of cluster models). Both run
client by client (its :class:`~fedcluster.protocol.client_side.ClientContext`) with
autograd through the flat parameter layout
(:class:`~fedcluster.engine.flat.ParamLayout`), so any model works and a
Flower node computes exactly what the simulator does (:func:`single_threaded`: a
product's float32 sums do not depend on how many threads split it). Plain SGD only: the
algorithms refuse momentum, FedProx's μ and local DP (:func:`check_plain_sgd`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fedcluster.errors import ConfigError
from fedcluster.protocol.batches import LocalTraining

if TYPE_CHECKING:
    from fedcluster.algorithms.base import Context
    from fedcluster.protocol.client_side import ClientContext


def check_plain_sgd(ctx: Context, name: str) -> None:
    """Refuse what :func:`weighted_sgd` does not implement (one line naming the field)."""
    if ctx.privacy is not None:
        raise ConfigError(f"privacy: {name} has no local-DP release of its uploads; remove privacy")
    if ctx.train.momentum > 0.0 or ctx.train.mu > 0.0:
        raise ConfigError(f"train: {name} trains with plain SGD; set momentum and mu to 0")


@contextmanager
def single_threaded() -> Iterator[None]:
    """Run the enclosed operators on one intra-op thread, so their float rounding is the
    same in the simulator (many threads) and on a Flower node (its own count)."""
    intra = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(intra)


@torch.no_grad()
def sample_losses(client: ClientContext, models: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each of K ``models`` [K, d] on each of the client's training
    samples, in stored order: [n, K] (float64)."""
    data = client.data
    x, y = data.x_train, data.y_train
    out = torch.empty(len(y), len(models), dtype=torch.float64)
    for k, row in enumerate(models):
        logits = client.forward(row.to(x.device), x)
        out[:, k] = F.cross_entropy(logits, y, reduction="none").double().cpu()
    return out


def weighted_sgd(
    client: ClientContext,
    start: torch.Tensor,
    cfg: LocalTraining,
    rnd: int,
    purpose: str,
    sample_weight: torch.Tensor | None = None,
    anchor: torch.Tensor | None = None,
    mu: float = 0.0,
) -> tuple[torch.Tensor, float]:
    """Mini-batch SGD of the client from ``start`` [d] over its batch plan for ``purpose``.

    Each batch's loss is Σ_i a_i ℓ_i / |B| with ``sample_weight`` a [n] (the client's
    samples in stored order; default 1: the mean loss), plus (μ/2)‖w − anchor‖².
    Returns the trained row and the mean batch loss (NaN without batches).
    """
    data = client.data
    plan = client.plan(cfg, rnd, purpose)
    device = data.x_train.device  # train where the data is (engine.device)
    w = start.to(device, copy=True)
    anchor = None if anchor is None else anchor.to(device)
    if sample_weight is not None:
        sample_weight = sample_weight.to(device)
    total = 0.0
    for idx in plan:
        leaf = w.clone().requires_grad_(True)
        x, y = data.x_train[idx], data.y_train[idx]
        losses = F.cross_entropy(client.forward(leaf, x), y, reduction="none")
        if sample_weight is None:
            loss = losses.mean()
        else:
            loss = (losses * sample_weight[idx].to(losses.dtype)).sum() / len(idx)
        (grad,) = torch.autograd.grad(loss, leaf)
        if mu > 0.0 and anchor is not None:
            grad = grad + mu * (w - anchor)
        w = w - cfg.lr * grad
        total += float(loss.detach())
    return w, (total / len(plan) if plan else float("nan"))
