"""Local differential privacy: clipping, the Gaussian mechanism, calibration and accounting.

Two forms, both applied on the client, before anything leaves it (local DP:
the server and everyone downstream is the adversary):

- **client-level** -- DCFL's setting (Augello et al. 2023, Sec. I and III,
  dcfl-dynamic-cfl-differential-privacy.md: "before transmitting the locally
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
is replaced by NaN, which :meth:`~fedcluster.algorithms.base.Context.exchange`
rejects like any malformed upload, so the server never receives it. Hence
the reported ε (the maximum over clients of ε spent so far) is monotone and
never above the target.

Randomness (DESIGN principle 4): client-level noise comes from
``torch_rng(seed, "dp", round, client, k)``, DP-SGD noise from
``torch_rng(seed, "dp-sgd/<purpose>", round, client, k)``, with k the number
of uploads the client has released so far: same seed, same noise, and no two
releases of a client ever share noise (a client may upload twice in a round,
e.g. a DCFL newcomer, and FedGroup's pre-training uploads carry round 0).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import lru_cache
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value, vmap

from fedcluster.rng import torch_rng

if TYPE_CHECKING:
    from torch import nn

    from fedcluster.algorithms.base import Context
    from fedcluster.config import ExperimentConfig
    from fedcluster.engine.batches import LocalTraining
    from fedcluster.engine.flat import ParamLayout

log = logging.getLogger("fedcluster")

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
    layout: ParamLayout, row: torch.Tensor, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy gradient [B, d] of every sample w.r.t. the flat row, and its loss [B].

    ``vmap(grad_and_value(...))`` over ``functional_call`` (torch.func), so it works
    for any ``nn.Module`` without per-sample state (no BatchNorm in training
    mode).
    """
    module: nn.Module = layout.module

    def loss_one(w: torch.Tensor, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        logits = functional_call(module, layout.unflatten(w), (xi.unsqueeze(0),))
        return F.cross_entropy(logits, yi.unsqueeze(0))

    grads, losses = vmap(grad_and_value(loss_one), in_dims=(None, 0, 0))(row, x, y)
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
    ledger: LocalDP | None = None
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
    """One client's release rule for one upload (:meth:`LocalDP.ticket`).

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
    clients: Sequence[int],
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
        for j, i in enumerate(np.flatnonzero(noisy)):
            t = tickets[i]
            gen = torch_rng(seed, "dp", rnd, int(clients[i]), t.release)
            updates[j] += gaussian_noise(updates.shape[1:], t.noise_multiplier * t.clip, gen)
        out[mask] = start[mask] + updates
    out[torch.as_tensor(~allowed)] = float("nan")
    return out


# ----------------------------------------------------------------- the ledger
class LocalDP:
    """A job's local differential privacy: release rules, DP-SGD option and ledger.

    Installed as :attr:`~fedcluster.algorithms.base.Context.privacy`, so it
    applies to every algorithm's uploads through
    :meth:`~fedcluster.algorithms.base.Context.exchange`: the backend's
    ``train`` releases each upload where the client is
    (:func:`release_uploads`, from the client's :meth:`ticket`), and
    :meth:`record` then enters what was released in the ledger. Per client it
    keeps σ_i, the sample rate q_i, the budget (steps) and the steps and
    uploads released so far.
    """

    def __init__(
        self,
        mode: Literal["client", "record"],
        *,
        seed: int,
        clip: float,
        delta: float,
        noise_multiplier: np.ndarray,
        sample_rate: np.ndarray,
        budget: np.ndarray,
        accountant: Accountant = "rdp",
        poisson: bool = True,
        target_epsilon: float | None = None,
    ) -> None:
        self.mode = mode
        self.seed = int(seed)
        self.clip = float(clip)
        self.delta = float(delta)
        self.noise_multiplier = np.asarray(noise_multiplier, dtype=np.float64)
        self.sample_rate = np.asarray(sample_rate, dtype=np.float64)
        self.budget = np.asarray(budget, dtype=np.int64)
        self.accountant: Accountant = accountant
        self.poisson = poisson
        self.target_epsilon = target_epsilon
        n = len(self.noise_multiplier)
        self.steps = np.zeros(n, dtype=np.int64)  # sampled Gaussian steps released
        self.releases = np.zeros(n, dtype=np.int64)  # uploads released
        self._warned: set[int] = set()

    # ----------------------------------------------------------- building
    @classmethod
    def from_config(
        cls, config: ExperimentConfig, train_sizes: np.ndarray, seed: int
    ) -> LocalDP | None:
        """The job's privacy from the config's ``privacy`` section (None when off)."""
        p = config.privacy
        if p.mode == "none":
            return None
        sizes = np.asarray(train_sizes, dtype=np.int64)
        n = len(sizes)
        uploads = max_participations(config, n)
        t = config.train
        if p.mode == "client":
            q = np.ones(n)
            budget = np.full(n, uploads, dtype=np.int64)
        else:
            per_epoch = np.array([steps_per_epoch(int(s), t.batch_size) for s in sizes])
            per_training = np.full(n, t.steps) if t.steps is not None else t.epochs * per_epoch
            if p.sampling == "poisson":
                q = 1.0 / per_epoch
            else:
                q = np.minimum(1.0, t.batch_size / np.maximum(sizes, 1))
            budget = (per_training * uploads).astype(np.int64)
        sigma = np.array(
            [
                calibrate_noise(p.epsilon, p.delta, float(qi), int(b), p.accountant)
                for qi, b in zip(q, budget, strict=True)
            ]
        )
        return cls(
            p.mode,
            seed=seed,
            clip=p.clip,
            delta=p.delta,
            noise_multiplier=sigma,
            sample_rate=q,
            budget=budget,
            accountant=p.accountant,
            poisson=p.sampling == "poisson",
            target_epsilon=p.epsilon,
        )

    @classmethod
    def install(cls, ctx: Context, config: ExperimentConfig) -> LocalDP | None:
        """Build from ``config`` and install in ``ctx`` (its privacy; DP-SGD for record level)."""
        dp = cls.from_config(config, ctx.train_sizes, ctx.seed)
        if dp is not None:
            ctx.train = dp.local_training(ctx.train)
            ctx.privacy = dp
        return dp

    def local_training(self, train: LocalTraining) -> LocalTraining:
        """``train`` with DP-SGD switched on (record level); unchanged for client level."""
        if self.mode != "record":
            return train
        record = RecordDP(
            clip=self.clip,
            noise_multiplier=tuple(float(s) for s in self.noise_multiplier),
            poisson=self.poisson,
            ledger=self,
        )
        return replace(train, dp=record)

    # ------------------------------------------------------------ upload
    def ticket(self, client: int) -> UploadTicket:
        """Client ``client``'s release rule for its next upload."""
        return UploadTicket(
            mode=self.mode,
            clip=self.clip,
            noise_multiplier=float(self.noise_multiplier[client]),
            release=int(self.releases[client]),
            remaining=int(self.budget[client] - self.steps[client]),
        )

    def record(self, clients: np.ndarray, steps: torch.Tensor, rnd: int) -> None:
        """Enter in the ledger what ``clients`` released after trainings of ``steps``
        steps (:func:`release_uploads` ran in the backend's ``train``, with the same
        tickets): a release costs its ticket's steps; a withheld upload costs nothing."""
        for c, n in zip(np.asarray(clients, dtype=np.int64), steps.tolist(), strict=True):
            ticket = self.ticket(int(c))
            if ticket.allows(int(n)):
                self.steps[c] += ticket.cost(int(n))
                self.releases[c] += 1
                continue
            if int(c) not in self._warned:
                self._warned.add(int(c))
                log.warning(
                    "round %d: client %d has spent its privacy budget (%d of %d steps); "
                    "its uploads are withheld from now on",
                    rnd,
                    c,
                    self.steps[c],
                    self.budget[c],
                )

    # ------------------------------------------------------- accounting
    def epsilons(self) -> np.ndarray:
        """ε spent so far by every client (0 for a client that has released nothing)."""
        return np.array(
            [
                epsilon_spent(
                    float(self.noise_multiplier[c]),
                    float(self.sample_rate[c]),
                    int(self.steps[c]),
                    self.delta,
                    self.accountant,
                )
                for c in range(len(self.steps))
            ]
        )

    def max_epsilon(self) -> float:
        """The largest ε spent so far over clients (the ``epsilon`` column of metrics.csv)."""
        eps = self.epsilons()
        return float(eps.max()) if len(eps) else 0.0

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue the accounting (σ etc. are recomputed)."""
        return {"steps": self.steps.copy(), "releases": self.releases.copy()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None:
            return
        self.steps = np.asarray(state["steps"], dtype=np.int64).copy()
        self.releases = np.asarray(state["releases"], dtype=np.int64).copy()


def max_participations(config: ExperimentConfig, n_clients: int) -> int:
    """Uploads a client may make: an int, the rounds, or the expected count under participation."""
    m = config.privacy.max_participations
    if isinstance(m, int):
        return m
    if m == "rounds":
        return config.rounds
    part = config.participation
    if part.fraction is not None:
        rate = part.fraction
    elif part.count is not None:
        rate = min(1.0, part.count / max(n_clients, 1))
    else:
        rate = 1.0
    return max(1, math.ceil(config.rounds * rate))


def reported_epsilon(ctx: Context) -> float:
    """The ``epsilon`` metric: max ε spent over clients, NaN without local DP."""
    return math.nan if ctx.privacy is None else ctx.privacy.max_epsilon()
