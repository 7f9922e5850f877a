"""Local differential privacy, the mechanisms: clipping, Gaussian noise, calibration, accounting.

This module sits below the engine (the simulator and a Flower node release
uploads with it); the run-level ledger that decides who may still release is
:class:`fedcluster.privacy.ledger.LocalDP`.

Two forms, both applied on the client, before anything leaves it (local DP:
the server and everyone downstream is the adversary):

- **client-level** -- DCFL's setting (Augello et al. 2023, Sec. I and III:
  "before transmitting the locally
  trained models, clients perform norm clipping ... and add Gaussian ...
  noise, so that privacy is preserved even if the server aggregating model
  updates is compromised"; ε = 10, δ = 1e−5). The client's update
  u = trained row − start row is clipped to L2 norm C and released as
  start + u·min(1, C/‖u‖) + N(0, σ²C²·I). Neighbouring relation: add or
  remove one client's whole data set (the removed client's update is 0), so
  the L2 sensitivity of one release is C and each upload is one Gaussian
  mechanism with noise multiplier σ; a client's uploads compose without
  subsampling amplification (the server knows who uploaded: sample rate 1).
  It protects everything a client holds, not just one record.
- **record-level** -- DP-SGD (Abadi et al., "Deep learning with differential
  privacy", CCS 2016, Alg. 1) inside local training: every per-sample
  gradient is clipped to norm C, the clipped gradients of a batch are summed,
  N(0, σ²C²·I) is added and the sum is divided by the expected batch size.
  Neighbouring relation: add or remove one sample of one client's data set.
  Each step is a sampled Gaussian mechanism with sample rate q; a client's
  steps over all its uploaded trainings compose.

Accounting uses Opacus' accountants (``opacus.accountants``: RDP, Mironov
2017 / Mironov et al. 2019, or PRV, Gopi et al. 2021) and its
``get_noise_multiplier`` for calibration; nothing here re-derives a privacy
formula. Both accountants assume **Poisson sampling** with rate q. Record-level
DP therefore plans Poisson batches by default (each sample joins each step
independently with probability q = 1/⌈n_i/B⌉, as Opacus' ``DPDataLoader``; the
number of steps per epoch is ⌈n_i/B⌉); ``sampling: shuffle`` keeps the usual
shuffled fixed-size batches with q = B/n_i, for which the reported ε is the
customary Poisson number and not a proof (shuffling is not covered by this
analysis).

Budget. σ is calibrated, per client, so that the client's budgeted number of
steps reaches at most (ε, δ): ``max_participations`` uploads (default: the
number of rounds, the worst case of every round) of one step each
(client-level) or of that client's steps per local training (record-level).
The ledger counts what each client actually released; an upload that would
exceed its budget is *withheld* (the client stops participating): its row
is replaced by NaN, which the channel
(:class:`~fedcluster.protocol.channel.Channel`) rejects like any malformed
upload, so the server never receives it. Hence
the reported ε (the maximum over clients of ε spent so far) is monotone and
never above the target.

Randomness: client-level noise comes from
``torch_rng(seed, "dp", round, client, k)``, DP-SGD noise from
``torch_rng(seed, "dp-sgd/<purpose>", round, client, k)``, with k the number
of uploads the client has released so far: same seed, same noise, and no two
releases of a client ever share noise (a client may upload twice in a round,
e.g. a DCFL newcomer, and FedGroup's pre-training uploads carry round 0).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value, vmap

from fedcluster.errors import ConfigError
from fedcluster.rng import torch_rng

if TYPE_CHECKING:
    from torch import nn

    from fedcluster.engine.flat import ParamLayout

Accountant = Literal["rdp", "prv"]
Mode = Literal["none", "client", "record"]


# ------------------------------------------------------------------ mechanism
def clip_rows(rows: torch.Tensor, clip: float) -> torch.Tensor:
    """Each row [n, d] scaled to L2 norm at most ``clip`` (``g / max(1, ‖g‖/C)``, Abadi Alg. 1)."""
    norms = rows.norm(dim=1, keepdim=True)
    return rows * (clip / norms.clamp(min=clip))


def gaussian_noise(
    shape: Sequence[int] | torch.Size, std: float, generator: torch.Generator
) -> torch.Tensor:
    """N(0, std²) float32 noise of ``shape`` from ``generator`` (zeros when std is 0)."""
    if std == 0.0:
        return torch.zeros(tuple(shape))
    return torch.randn(tuple(shape), generator=generator).mul_(std)


def per_sample_gradients(
    layout: ParamLayout,
    row: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient [B, d] of ``loss`` (default cross-entropy) of every sample w.r.t. the
    flat row, and its loss [B].

    ``vmap(grad_and_value(...))`` over ``functional_call`` (torch.func), so it works
    for any ``nn.Module`` without per-sample state (no BatchNorm in training
    mode). Random operations (Dropout) draw a different mask per sample.
    """
    module: nn.Module = layout.module

    def loss_one(w: torch.Tensor, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        logits = functional_call(module, layout.unflatten(w), (xi.unsqueeze(0),))
        return loss(logits, yi.unsqueeze(0))

    per_sample = vmap(grad_and_value(loss_one), in_dims=(None, 0, 0), randomness="different")
    grads, losses = per_sample(row, x, y)
    return grads.detach(), losses.detach()


def noisy_clipped_sum(
    grads: torch.Tensor, clip: float, noise_multiplier: float, generator: torch.Generator
) -> torch.Tensor:
    """Σ_i clip(g_i, C) + N(0, σ²C²·I): the DP-SGD gradient before division by the batch size."""
    total = clip_rows(grads, clip).sum(dim=0) if len(grads) else torch.zeros(grads.shape[1])
    return total + gaussian_noise(total.shape, noise_multiplier * clip, generator)


# ---------------------------------------------------------------- accounting
@contextmanager
def _quiet() -> Iterator[None]:
    """Opacus warns on q = 1 (log 0 inside the PRV) and at extreme σ during the search."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        warnings.simplefilter("ignore", UserWarning)
        yield


@lru_cache(maxsize=1)
def _opacus() -> SimpleNamespace:
    """Opacus' accountant functions, imported on first use: the import takes
    about 1.6 s, which runs without privacy (and every Flower message) skip."""
    from opacus.accountants import create_accountant
    from opacus.accountants.analysis import rdp
    from opacus.accountants.rdp import RDPAccountant
    from opacus.accountants.utils import get_noise_multiplier

    return SimpleNamespace(
        create_accountant=create_accountant,
        rdp=rdp,
        alphas=RDPAccountant.DEFAULT_ALPHAS,
        get_noise_multiplier=get_noise_multiplier,
    )


@lru_cache(maxsize=4096)
def calibrate_noise(
    epsilon: float, delta: float, sample_rate: float, steps: int, accountant: Accountant = "rdp"
) -> float:
    """Noise multiplier σ with which ``steps`` sampled Gaussian steps at rate q spend ≤ (ε, δ).

    Opacus' ``get_noise_multiplier`` (binary search to within 0.01 of ε,
    from below). Client-level uploads are steps with q = 1.
    """
    if steps <= 0:
        return 0.0
    try:
        with _quiet():
            return float(
                _opacus().get_noise_multiplier(
                    target_epsilon=epsilon,
                    target_delta=delta,
                    sample_rate=sample_rate,
                    steps=int(steps),
                    accountant=accountant,
                )
            )
    except ValueError as exc:  # Opacus: "The privacy budget is too low."
        raise ConfigError(
            f"privacy: no noise level spends at most epsilon={epsilon:g}, delta={delta:g} "
            f"over {int(steps)} steps at sampling rate {sample_rate:g} ({exc}); "
            "raise privacy.epsilon or lower the uploads"
        ) from None


@lru_cache(maxsize=4096)
def _rdp_one_step(noise_multiplier: float, sample_rate: float) -> np.ndarray:
    with _quiet():
        rdp = _opacus().rdp.compute_rdp(
            q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=_opacus().alphas
        )
    return np.asarray(rdp)


@lru_cache(maxsize=65536)
def epsilon_spent(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: Accountant = "rdp",
) -> float:
    """ε after ``steps`` sampled Gaussian steps (σ, q) at δ, by Opacus' accountant.

    For RDP this is what ``RDPAccountant.get_epsilon`` computes for the
    history ``[(σ, q, steps)]`` (RDP of a step times ``steps``, converted at
    the best of the default orders), with the one-step RDP cached so a
    per-round report costs microseconds.
    """
    if steps <= 0:
        return 0.0
    if noise_multiplier <= 0.0:
        return math.inf
    with _quiet():
        if accountant == "rdp":
            rdp = _rdp_one_step(noise_multiplier, sample_rate) * int(steps)
            eps, _ = _opacus().rdp.get_privacy_spent(orders=_opacus().alphas, rdp=rdp, delta=delta)
            return float(eps)
        acc = _opacus().create_accountant(mechanism=accountant)
        acc.history = [(noise_multiplier, sample_rate, int(steps))]
        return float(acc.get_epsilon(delta=delta))


# --------------------------------------------------------------- DP-SGD option
class ReleaseCounter(Protocol):
    """What keys a client's noise: its uploads released so far (the ledger's count)."""

    releases: np.ndarray


@dataclass(frozen=True, eq=False)
class RecordDP:
    """DP-SGD settings of local training (``LocalTraining.dp``; Abadi et al. 2016, Alg. 1).

    ``noise_multiplier`` is one σ for all clients or a sequence indexed by
    client id. ``poisson`` plans Poisson batches (what the accountant
    assumes) instead of shuffled ones. ``ledger`` (optional) supplies the
    release counter that keys the noise; without it the counter is
    ``release`` (a Flower node training its one client gets it in the request).
    """

    clip: float
    noise_multiplier: float | Sequence[float] = 1.0
    poisson: bool = True
    ledger: ReleaseCounter | None = None
    release: int = 0

    def sigma(self, client: int) -> float:
        s = self.noise_multiplier
        return float(s) if isinstance(s, int | float) else float(s[client])

    def releases(self, client: int) -> int:
        """The client's uploads released so far: the counter that keys its noise."""
        return self.release if self.ledger is None else int(self.ledger.releases[client])

    def generator(self, seed: int, purpose: str, rnd: int, client: int) -> torch.Generator:
        return torch_rng(seed, f"dp-sgd/{purpose}", rnd, client, self.releases(client))


def steps_per_epoch(n_samples: int, batch_size: int) -> int:
    """Batches per epoch, ⌈n/B⌉ (also Opacus' Poisson steps per epoch)."""
    return max(1, math.ceil(n_samples / batch_size))


@dataclass(frozen=True)
class UploadTicket:
    """One client's release rule for one upload (:meth:`fedcluster.privacy.ledger.LocalDP.ticket`).

    What a client needs to privatise its own upload or withhold it: the
    mode, clip C and noise multiplier σ, how many uploads it has released
    (keys the noise) and how many steps its budget has left. A release costs
    1 step (client level) or the DP-SGD steps of the training (record level).
    """

    mode: Literal["client", "record"]
    clip: float
    noise_multiplier: float
    release: int
    remaining: int

    def cost(self, steps: int) -> int:
        """Budget steps a release costs after a training of ``steps`` steps."""
        return steps if self.mode == "record" else 1

    def allows(self, steps: int) -> bool:
        return self.cost(steps) <= self.remaining


def release_uploads(
    tickets: Sequence[UploadTicket],
    clients: Sequence[int] | np.ndarray,
    start: torch.Tensor,
    trained: torch.Tensor,
    steps: torch.Tensor,
    seed: int,
    rnd: int,
) -> torch.Tensor:
    """What clients upload [n, d] after training from ``start`` to ``trained`` [n, d].

    Client level: start + clip(trained − start, C) + N(0, σ²C²·I), the noise
    from ``torch_rng(seed, "dp", rnd, client, release)``; record level: the
    trained row (DP-SGD already privatised it). A client whose budget does
    not allow the release withholds it: its row is NaN, which the server
    rejects like any malformed upload. Runs where the client is: in the
    simulator's process or on the client's Flower node.
    """
    if len({t.clip for t in tickets}) > 1:
        raise ValueError("release_uploads: the tickets of one call must share the clip C")
    out = trained.clone()
    allowed = np.array([t.allows(int(n)) for t, n in zip(tickets, steps, strict=True)], dtype=bool)
    noisy = allowed & np.array([t.mode == "client" for t in tickets], dtype=bool)
    if noisy.any():
        mask = torch.as_tensor(noisy)
        updates = clip_rows(trained[mask] - start[mask], tickets[0].clip)
        for j, i in enumerate(np.flatnonzero(noisy).tolist()):
            t = tickets[i]
            gen = torch_rng(seed, "dp", rnd, int(clients[i]), t.release)
            updates[j] += gaussian_noise(updates.shape[1:], t.noise_multiplier * t.clip, gen)
        out[mask] = start[mask] + updates
    out[torch.as_tensor(~allowed)] = float("nan")
    return out


def release_vectors(
    tickets: Sequence[UploadTicket],
    clients: Sequence[int] | np.ndarray,
    values: torch.Tensor,
    seed: int,
    rnd: int,
    purpose: str,
) -> torch.Tensor:
    """Client-level release of uploads that are not model updates (e.g. CFLGT's trajectory).

    Each client's upload, flattened, is clipped to L2 norm C and released with
    N(0, σ²C²·I): the same Gaussian mechanism as :func:`release_uploads`, so
    the ledger counts it as one release. The noise comes from
    ``torch_rng(seed, "dp/<purpose>", rnd, client, release)``. A withheld
    upload is NaN. Only client level: a record-level release of such a
    statistic would need a per-sample sensitivity bound that the papers do not
    give, so the channel refuses that combination.
    """
    out = values.clone()
    flat = out.reshape(len(out), -1)
    for i, (t, c) in enumerate(zip(tickets, clients, strict=True)):
        if t.mode != "client":
            raise ValueError("release_vectors: only client-level local DP releases such uploads")
        if not t.allows(1):
            flat[i] = float("nan")
            continue
        gen = torch_rng(seed, f"dp/{purpose}", rnd, int(c), t.release)
        noisy = clip_rows(flat[i : i + 1], t.clip)[0]
        flat[i] = noisy + gaussian_noise(noisy.shape, t.noise_multiplier * t.clip, gen)
    return out
