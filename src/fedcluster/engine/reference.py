"""The plain per-client PyTorch loop: the ground truth for the fast simulator.

One ``nn.Module`` per client, batches by index slicing over the packed data,
``torch.optim.SGD``, FedProx's proximal term added to the loss, the module in
``train()`` with its BatchNorm statistics carried in its ``state_dict`` --
what an FL researcher would write by hand. Dropout draws from the client's
derived generator (:mod:`fedcluster.engine.modes`), as on the simulator.
:mod:`fedcluster.engine.simulator` must agree with it to float tolerance
(tests) and beat it in speed (benchmarks).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedcluster.data.federation import Federation
from fedcluster.engine.flat import ParamLayout
from fedcluster.engine.modes import LossFn, training
from fedcluster.protocol.batches import LocalTraining, augmenter, batch_plan
from fedcluster.rng import torch_rng


def reference_train(
    model: nn.Module,
    federation: Federation,
    clients: np.ndarray,
    start: torch.Tensor,
    cfg: LocalTraining,
    seed: int,
    rnd: int,
    purpose: str = "train",
    loss_fn: LossFn = F.cross_entropy,
) -> torch.Tensor:
    """Train each client with a plain loop; returns rows [n, d] (parameters, then
    float buffers: :class:`~fedcluster.engine.flat.ParamLayout`)."""
    layout = ParamLayout(model)
    local = copy.deepcopy(model)
    cfg = cfg.at_round(rnd)
    out = torch.empty(len(clients), layout.dim)
    for i, c in enumerate(clients):
        row = start if start.dim() == 1 else start[i]
        layout.load_into(local, row)
        anchor = [p.detach().clone() for p in local.parameters()]
        opt = torch.optim.SGD(local.parameters(), lr=cfg.lr, momentum=cfg.momentum)
        sl = federation.client_slice(int(c))
        x, y = federation.x_train[sl], federation.y_train[sl]
        gen = torch_rng(seed, f"dropout/{purpose}", rnd, int(c))
        augment = augmenter(cfg, seed, purpose, rnd, int(c))
        for idx in batch_plan(len(y), cfg, seed, purpose, rnd, int(c)):
            opt.zero_grad()
            inputs = x[idx] if augment is None else augment(x[idx])
            with training(local, gen):
                loss = loss_fn(local(inputs), y[idx])
            if cfg.mu > 0.0:
                prox = sum(
                    ((p - a) ** 2).sum() for p, a in zip(local.parameters(), anchor, strict=True)
                )
                loss = loss + 0.5 * cfg.mu * prox
            loss.backward()
            opt.step()
        out[i] = layout.flatten(local)
    return out
