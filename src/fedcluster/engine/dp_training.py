"""DP-SGD steps for the simulator's training strategies.

Record-level local differential privacy by DP-SGD (Abadi et al., "Deep
Learning with Differential Privacy", Alg. 1): each step's per-sample gradients
are clipped to ``dp.clip``, summed, given N(0, σ²C²) noise and divided by the
expected batch size q·n (Poisson plan) or by the batch's size (shuffled plan,
where it is fixed: with σ = 0 and a large clip this is plain SGD). FedProx's term
and momentum act on the privatised gradient (post-processing).

:func:`dp_step_gradients` gives each client's step for any model on the
autograd path (per-sample gradients by ``vmap(grad(...))``,
:func:`~fedcluster.privacy.mechanisms.per_sample_gradients`);
:func:`dp_group_steps` gives a group's step for MLPs on the kernel
(:meth:`~fedcluster.engine.mlp_kernel.MLPKernel.dp_sgd_step`, which clips
per-sample gradients without materialising them). Both draw the same noise (one
N(0, I) vector over the trainable part of the row per client and step) and agree
to float tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from fedcluster.engine.autograd_training import StepGradient
from fedcluster.engine.kernel_training import GroupStep, KernelTraining
from fedcluster.engine.mlp_kernel import LayerParams
from fedcluster.engine.training_inputs import TrainingInputs
from fedcluster.errors import FedclusterError
from fedcluster.privacy.mechanisms import (
    RecordDP,
    gaussian_noise,
    noisy_clipped_sum,
    per_sample_gradients,
)
from fedcluster.protocol.batches import LocalTraining


def check_per_sample_model(model: nn.Module) -> None:
    """DP-SGD's per-sample gradients are undefined under BatchNorm's batch statistics."""
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        raise FedclusterError(
            "privacy: record-level DP-SGD needs per-sample gradients, which BatchNorm's "
            "batch statistics mix across samples; use GroupNorm or LayerNorm (as Opacus)"
        )


def expected_batch(n_samples: int, batch_size: int) -> float:
    """Expected Poisson batch size q·n with q = 1/⌈n/B⌉ (the DP-SGD denominator)."""
    return n_samples / max(1, math.ceil(n_samples / batch_size))


def dp_step_gradients(
    inputs: TrainingInputs,
    dp: RecordDP,
    cfg: LocalTraining,
    clients: np.ndarray,
    rnd: int,
    purpose: str,
) -> Callable[[int], StepGradient]:
    """Client ``clients[i]``'s DP-SGD step gradient for any model, by ``i``."""
    fed = inputs.federation
    sizes = fed.train_sizes

    def gradients(i: int) -> StepGradient:
        c = int(clients[i])
        sigma = dp.sigma(c)
        gen = dp.generator(inputs.seed, purpose, rnd, int(inputs.client_ids[c]))
        expected = expected_batch(int(sizes[c]), cfg.batch_size)

        def step(w: torch.Tensor, idx: torch.Tensor, head: slice) -> tuple[torch.Tensor, float]:
            loss = 0.0
            if len(idx):
                x, y = fed.x_train[idx], fed.y_train[idx]
                grads, sample_loss = per_sample_gradients(inputs.layout, w, x, y, inputs.loss)
                grads = grads[:, head]
                loss = float(sample_loss.mean())
            else:
                grads = torch.zeros(0, head.stop - head.start)
            g = noisy_clipped_sum(grads, dp.clip, sigma, gen)
            return g / (expected if dp.poisson else max(1, len(idx))), loss

        return step

    return gradients


def dp_group_steps(
    training: KernelTraining,
    dp: RecordDP,
    plans: list[list[torch.Tensor]],
    clients: np.ndarray,
    cfg: LocalTraining,
    head: slice,
    first_trainable: int,
    rnd: int,
    purpose: str,
) -> Callable[[np.ndarray], GroupStep]:
    """The DP-SGD step of a group of MLP clients on the kernel, by its members
    (positions in ``clients``); ``head`` is the trainable part of the row, from
    layer ``first_trainable`` on."""
    inputs, kernel = training.inputs, training.kernel
    sizes = inputs.federation.train_sizes
    steps = torch.tensor([len(p) for p in plans], dtype=torch.int64)
    width = head.stop - head.start

    def group_step(members: np.ndarray) -> GroupStep:
        ids = [int(clients[m]) for m in members]
        gens = [dp.generator(inputs.seed, purpose, rnd, int(inputs.client_ids[c])) for c in ids]
        stds = [dp.sigma(c) * dp.clip for c in ids]
        expected = [expected_batch(int(sizes[c]), cfg.batch_size) for c in ids]

        def step(
            params: LayerParams,
            s: int,
            idx: torch.Tensor,
            weight: torch.Tensor,
            anchors: LayerParams | None,
        ) -> torch.Tensor:
            active = steps[members] > s
            noise = torch.zeros(len(members), width)
            scale = torch.zeros(len(members))
            for j in np.flatnonzero(active.numpy()):
                noise[j] = gaussian_noise((width,), stds[j], gens[j])
                size = len(plans[members[j]][s])
                scale[j] = 1.0 / (expected[j] if dp.poisson else max(1, size))
            return active * kernel.dp_sgd_step(
                params,
                inputs.x_flat[idx],
                inputs.federation.y_train[idx],
                (weight > 0).to(torch.float32),
                cfg.lr,
                dp.clip,
                noise,
                scale,
                first_trainable=first_trainable,
                mu=cfg.mu,
                anchors=anchors,
            )

        return step

    return group_step
