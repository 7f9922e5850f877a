"""Local training settings and the mini-batch plan of one client.

The plan is the list of index tensors a client visits, derived from
``(seed, purpose, round, client)`` alone, so the fast batched simulator, the
plain reference loop and a real Flower client all see the same batches.
Batches follow ``DataLoader(shuffle=True, drop_last=False)``: each epoch is a
fresh permutation cut into chunks of ``batch_size`` (the last may be smaller).
With ``steps`` set, exactly that many batches are taken (FedGroup/JGL "tau
local steps"), continuing into further epochs as needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedcluster.rng import torch_rng


@dataclass(frozen=True)
class LocalTraining:
    """How a client trains: mini-batch SGD (McMahan et al. FedAvg, Alg. 1).

    ``mu`` > 0 adds FedProx's proximal term (mu/2)·||w − w_anchor||² (Li et al. 2020).
    """

    lr: float = 0.05
    batch_size: int = 32
    epochs: int = 1
    steps: int | None = None
    momentum: float = 0.0
    mu: float = 0.0


def batch_plan(
    n_samples: int,
    cfg: LocalTraining,
    seed: int,
    purpose: str,
    rnd: int,
    client: int,
) -> list[torch.Tensor]:
    """The client's mini-batches as local index tensors, in visiting order."""
    if n_samples <= 0:
        return []
    gen = torch_rng(seed, f"batches/{purpose}", rnd, client)
    batches: list[torch.Tensor] = []
    target = cfg.steps
    epochs = cfg.epochs if target is None else None
    epoch = 0
    while True:
        if epochs is not None and epoch >= epochs:
            break
        perm = torch.randperm(n_samples, generator=gen)
        for chunk in perm.split(cfg.batch_size):
            batches.append(chunk)
            if target is not None and len(batches) == target:
                return batches
        epoch += 1
    return batches
