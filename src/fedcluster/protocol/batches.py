"""Local training settings and the mini-batch plan of one client.

The plan is the list of index tensors a client visits, derived from
``(seed, purpose, round, client)`` alone, so the fast batched simulator, the
plain reference loop and a real Flower client all see the same batches.
Batches follow ``DataLoader(shuffle=True, drop_last=False)``: each epoch is a
fresh permutation cut into chunks of ``batch_size`` (the last may be smaller).
With ``steps`` set, exactly that many batches are taken (FedGroup/JGL "tau
local steps"), continuing into further epochs as needed.

Under record-level differential privacy with Poisson sampling
(``LocalTraining.dp.poisson``, :mod:`fedcluster.privacy.ledger`) the plan is what
the privacy accountant assumes instead: ⌈n/B⌉ steps per epoch (or ``steps``),
each sample joining each step independently with probability q = 1/⌈n/B⌉
(Opacus' ``DPDataLoader``), so batch sizes vary and may be 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

import torch

from fedcluster.data.transforms import AUGMENTATIONS, random_crop_flip
from fedcluster.rng import torch_rng

if TYPE_CHECKING:
    from fedcluster.privacy.mechanisms import RecordDP


@dataclass(frozen=True)
class LocalTraining:
    """How a client trains: mini-batch SGD (McMahan et al. FedAvg, Alg. 1).

    ``mu`` > 0 adds FedProx's proximal term (mu/2)·||w − w_anchor||² (Li et al. 2020).
    ``dp`` switches on DP-SGD (record-level local differential privacy,
    :class:`fedcluster.privacy.mechanisms.RecordDP`). ``augment`` (``none`` or ``crop_flip``,
    :data:`fedcluster.data.transforms.AUGMENTATIONS`) transforms each training
    batch before its step (:func:`augmenter`). ``lr_decay`` < 1 decays the
    learning rate per communication round (:meth:`at_round`).
    """

    lr: float = 0.05
    batch_size: int = 32
    epochs: int = 1
    steps: int | None = None
    momentum: float = 0.0
    mu: float = 0.0
    dp: RecordDP | None = None
    augment: str = "none"
    lr_decay: float = 1.0

    def at_round(self, rnd: int) -> LocalTraining:
        """The settings of round ``rnd`` (counted from 1): learning rate
        lr·lr_decay^(rnd−1), as IFCA's CIFAR-10 code decays it (``lr_schedule``)."""
        if self.lr_decay == 1.0:
            return self
        return replace(self, lr=self.lr * self.lr_decay ** max(rnd - 1, 0), lr_decay=1.0)

    @property
    def plain_step(self) -> bool:
        """A step is the bare SGD update w -= lr·g: no momentum, no proximal term."""
        return self.momentum == 0.0 and self.mu == 0.0


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
    if cfg.dp is not None and cfg.dp.poisson:
        return _poisson_plan(n_samples, cfg, gen)
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


def augmenter(
    cfg: LocalTraining, seed: int, purpose: str, rnd: int, client: int
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The client's batch transform for ``cfg.augment`` (None: batches as they are).

    Its randomness comes from ``(seed, "augment/<purpose>", round, client)`` and is
    drawn batch after batch, so the simulator, the reference loop and a Flower
    client that follow the same plan see the same augmented images.
    """
    if cfg.augment not in AUGMENTATIONS:
        raise ValueError(f"augment: must be one of {list(AUGMENTATIONS)}, got {cfg.augment!r}")
    if cfg.augment == "none":
        return None
    gen = torch_rng(seed, f"augment/{purpose}", rnd, client)
    return partial(random_crop_flip, generator=gen)


def _poisson_plan(n_samples: int, cfg: LocalTraining, gen: torch.Generator) -> list[torch.Tensor]:
    """Poisson-sampled batches: ⌈n/B⌉ steps per epoch, each sample in with rate 1/⌈n/B⌉."""
    per_epoch = math.ceil(n_samples / cfg.batch_size)
    n_steps = cfg.steps if cfg.steps is not None else cfg.epochs * per_epoch
    q = 1.0 / per_epoch
    return [
        torch.nonzero(torch.rand(n_samples, generator=gen) < q).flatten() for _ in range(n_steps)
    ]
