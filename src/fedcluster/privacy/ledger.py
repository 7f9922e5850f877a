"""Local differential privacy of a run: the ledger of what each client has released.

The mechanisms (clipping, Gaussian noise, DP-SGD, calibration, accountants)
are in :mod:`fedcluster.privacy.mechanisms`, below the engine; this module is run-level
policy beside the runner: how much noise each client's budget allows
(calibrated once from the config), which uploads a client may still release
(:meth:`LocalDP.ticket`), and the ε spent so far (the ``epsilon`` column).
The channel (:class:`~fedcluster.protocol.channel.Channel`) hands each
asked client its ticket with the request, the client releases (or withholds)
where it is, and the channel enters every release in this ledger
(:meth:`LocalDP.record`). See :mod:`fedcluster.privacy.mechanisms` for the two forms
(client and record level), the neighbouring relations and the accounting.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from fedcluster.errors import ConfigError
from fedcluster.privacy.mechanisms import (
    Accountant,
    RecordDP,
    UploadTicket,
    calibrate_noise,
    epsilon_spent,
    steps_per_epoch,
)

if TYPE_CHECKING:
    import torch

    from fedcluster.config.schema import ExperimentConfig
    from fedcluster.privacy.central import CentralDP
    from fedcluster.protocol.batches import LocalTraining
    from fedcluster.protocol.computation import ClientComputation

log = logging.getLogger("fedcluster")


class LocalDP:
    """A job's local differential privacy: release rules, DP-SGD option and ledger.

    Installed in the job's channel (:class:`~fedcluster.protocol.channel.Channel`),
    so it applies to every upload of every computation that releases one: the
    client releases where it is (from its :meth:`ticket`), and :meth:`record`
    then enters what was released in the ledger. Per client it
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
        release_cost: np.ndarray | None = None,
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
        self.release_cost = (
            np.ones(n, dtype=np.int64) if release_cost is None else np.asarray(release_cost)
        )
        """Budget steps one upload costs each client (1, or its DP-SGD steps per training)."""
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
        mode = p.mode
        if mode == "none" or mode == "central":  # central: fedcluster.privacy.central
            return None
        sizes = np.asarray(train_sizes, dtype=np.int64)
        n = len(sizes)
        uploads = max_participations(config, n)
        t = config.train
        if p.mode == "client":
            q = np.ones(n)
            budget = np.full(n, uploads, dtype=np.int64)
            per_training = np.ones(n, dtype=np.int64)
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
            mode,
            seed=seed,
            clip=p.clip,
            delta=p.delta,
            noise_multiplier=sigma,
            sample_rate=q,
            budget=budget,
            accountant=p.accountant,
            poisson=p.sampling == "poisson",
            target_epsilon=p.epsilon,
            release_cost=per_training,
        )

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
    def check_release(self, computation: ClientComputation) -> None:
        """Refuse a release this ledger cannot account: at record level only a
        training's DP-SGD steps have a per-sample sensitivity (e.g. not CFLGT's
        trajectory, a statistic of all the client's samples)."""
        if self.mode == "record" and computation.release_cost is None:
            raise ConfigError(
                f"privacy.mode: record-level DP cannot release the {computation.name} upload "
                "(no per-sample sensitivity); use privacy.mode: client"
            )

    def ticket(self, client: int) -> UploadTicket:
        """Client ``client``'s release rule for its next upload."""
        return UploadTicket(
            mode=self.mode,
            clip=self.clip,
            noise_multiplier=float(self.noise_multiplier[client]),
            release=int(self.releases[client]),
            remaining=int(self.budget[client] - self.steps[client]),
        )

    def exhausted(self) -> bool:
        """Whether no client can afford another upload (the job can stop)."""
        return bool(np.all(self.budget - self.steps < self.release_cost))

    def record(self, clients: np.ndarray, steps: torch.Tensor, rnd: int) -> np.ndarray:
        """Enter in the ledger what ``clients`` released after trainings of ``steps``
        steps (the computation's release ran where the client is, with the same
        tickets; :func:`fedcluster.privacy.mechanisms.release_uploads`): a release costs its
        ticket's steps; a withheld upload costs nothing. Returns the mask of the
        clients that released (the others withheld: they sent nothing)."""
        released = np.zeros(len(clients), dtype=bool)
        for i, (c, n) in enumerate(
            zip(np.asarray(clients, dtype=np.int64), steps.tolist(), strict=True)
        ):
            ticket = self.ticket(int(c))
            if ticket.allows(int(n)):
                self.steps[c] += ticket.cost(int(n))
                self.releases[c] += 1
                released[i] = True
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
        return released

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
        return {"steps": self.steps.tolist(), "releases": self.releases.tolist()}

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
    return max(1, math.ceil(config.rounds * participation_rate(config, n_clients)))


def participation_rate(config: ExperimentConfig, n_clients: int) -> float:
    """The share of clients selected per round (``participation.fraction`` or ``count``; 1: all)."""
    part = config.participation
    if part.fraction is not None:
        return part.fraction
    if part.count is not None:
        return min(1.0, part.count / max(n_clients, 1))
    return 1.0


def reported_epsilon(privacy: LocalDP | CentralDP | None) -> float:
    """The ``epsilon`` metric: max ε spent over clients, NaN without privacy."""
    return math.nan if privacy is None else privacy.max_epsilon()
