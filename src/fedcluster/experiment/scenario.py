"""Dynamic federations: who is present, available, failing, drifting and faulty at round r.

The papers' dynamic settings:

- DCFL (Augello et al. 2023, Sec. III): "every ten
  communication rounds we introduce a new client"; "starting from the fifth
  communication round and every ten rounds after that a client is randomly
  selected and its data distribution is altered by changing the rotation
  angle" (``joins.every``/``count``, ``drift`` of kind ``rotate``);
- FedGroup (Duan et al., Sec. III-D): "the new devices
  can join the training at any time" and are placed by the client cold start
  (eq. 9);
- the usual FL system model (McMahan et al. 2017; Bonawitz et al., "Towards
  federated learning at scale", MLSys 2019): only some devices are reachable
  in a round (``availability``), and a selected device may drop out before it
  reports (``failure_rate``); plus faulty devices whose uploads are garbage
  (``faulty``: NaN, Inf or absurdly large updates), which the server must
  reject (:class:`~fedcluster.algorithms.base.UpdateBound`).

Definitions (round r, clients 0..n−1):

- *present*: joined (join round ≤ r) and not departed (r < leave round).
  Clients not listed in ``joins`` are present from round 1; ``joins.rounds``
  and ``joins.every``/``count`` (``size`` at a time) apply to the *last*
  clients, in id order (client n−k joins first). A client never trains, and is never selected or
  evaluated, before its join round.
- *available*: present, and reachable this round with probability
  ``availability`` (independently per client and round). The runner's
  selection (``participation``) draws among the available clients.
- *failing*: each client fails this round with probability ``failure_rate``;
  a failing client that the server contacts receives what is sent (counted
  in ``bytes_down``) but never replies (nothing counted up, nothing trained):
  see :meth:`~fedcluster.algorithms.base.Context.respond`. Failures are
  decided per (round, client), so they also hit the clients an algorithm
  contacts on its own (a clustering round, a cold start, CFLGT's draw).
- *drift*: :class:`~fedcluster.data.drift.DriftEvent` s at the start of a
  round, for given clients or one random present client per event.
- *faulty*: ``round(share·n)`` random clients, each with one fault from
  ``kinds`` (dealt in turn), corrupt every model they upload
  (:class:`FaultyUploads`, an upload transform that runs after any other,
  e.g. after local differential privacy), or, for ``label_flip``, the data
  they train on (:func:`flip_labels`: y → C−1−y on their own training
  samples, the label-flipping data-poisoning attack of Biggio et al., ICML
  2012, and Fung et al.'s FoolsGold evaluation, RAID 2020). ``alie`` clients
  collude: each sends the honest updates' coordinate-wise mean minus z
  standard deviations ("A little is enough", Baruch, Baruch, Goldberg,
  NeurIPS 2019), an update inside every norm bound.

All randomness derives from (seed, purpose, round, ...),
so a run and its resumed continuation see the same scenario.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from statistics import NormalDist
from typing import get_args

import numpy as np
import torch

from fedcluster.config.schema import DriftConfig, FaultKind, JoinsConfig, ScenarioConfig
from fedcluster.data.drift import DriftEvent
from fedcluster.data.federation import Federation
from fedcluster.errors import ConfigError
from fedcluster.rng import derive_seed, numpy_rng

NEVER = np.iinfo(np.int64).max  # the leave round of a client that stays
FAULTS: tuple[str, ...] = get_args(FaultKind)


class Scenario:
    """The dynamic schedule of one federation of ``n_clients`` under one seed."""

    def __init__(self, config: ScenarioConfig, n_clients: int, seed: int, rounds: int) -> None:
        self.config = config
        self.n_clients = n_clients
        self.seed = seed
        self.join_round = join_rounds(config.joins, n_clients)
        self.leave_round = np.full(n_clients, NEVER, dtype=np.int64)
        for client, rnd in config.leaves.items():
            self.leave_round[_client(client, n_clients, "scenario.leaves")] = rnd
        self.fault = faulty_clients(config.faulty.share, config.faulty.kinds, n_clients, seed)
        self._drift: dict[int, list[DriftEvent]] = {}
        for index, entry in enumerate(config.drift):
            for event in self._drift_events(index, entry, rounds):
                self._drift.setdefault(event.round, []).append(event)

    @property
    def has_drift(self) -> bool:
        return bool(self._drift)

    @property
    def regroups(self) -> bool:
        """Whether a drift event moves its client to another ground-truth group."""
        return any(e.regroup for events in self._drift.values() for e in events)

    def present(self, rnd: int) -> np.ndarray:
        """Mask of the clients that have joined by round ``rnd`` and not left."""
        return (self.join_round <= rnd) & (rnd < self.leave_round)

    def available(self, rnd: int) -> np.ndarray:
        """Mask of the present clients reachable in round ``rnd``."""
        present = self.present(rnd)
        if self.config.availability >= 1.0:
            return present
        draw = numpy_rng(self.seed, "scenario/availability", rnd).random(self.n_clients)
        return present & (draw < self.config.availability)

    def failing(self, rnd: int) -> np.ndarray:
        """Mask of the clients that do not reply in round ``rnd`` if asked."""
        if self.config.failure_rate <= 0.0:
            return np.zeros(self.n_clients, dtype=bool)
        draw = numpy_rng(self.seed, "scenario/failures", rnd).random(self.n_clients)
        return draw < self.config.failure_rate

    def masks(self, rnd: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Present, available and failing masks of round ``rnd`` (for ``Context.start_round``)."""
        return self.present(rnd), self.available(rnd), self.failing(rnd)

    def joins(self, rnd: int) -> np.ndarray:
        """Clients that join at round ``rnd`` (after round 1)."""
        return np.flatnonzero(self.join_round == rnd) if rnd > 1 else np.empty(0, np.int64)

    def leaves(self, rnd: int) -> np.ndarray:
        """Clients gone from round ``rnd`` on."""
        return np.flatnonzero(self.leave_round == rnd)

    def drifts(self, rnd: int) -> list[DriftEvent]:
        """Drift events at the start of round ``rnd``, in config order."""
        return self._drift.get(rnd, [])

    def drifts_through(self, rnd: int) -> list[DriftEvent]:
        """All drift events of rounds ``1..rnd`` in order (replayed when a run resumes)."""
        return [e for r in sorted(self._drift) if r <= rnd for e in self._drift[r]]

    def faulty(self) -> list[tuple[int, str]]:
        """``(client, fault)`` of every faulty client."""
        return [(int(c), FAULTS[self.fault[c]]) for c in np.flatnonzero(self.fault >= 0)]

    def label_flippers(self) -> np.ndarray:
        """The clients whose fault is ``label_flip`` (they train on flipped labels)."""
        return np.flatnonzero(self.fault == FAULTS.index("label_flip"))

    def upload_transform(self) -> FaultyUploads | None:
        """The faulty clients' upload transform, or ``None`` without faulty clients."""
        if not (self.fault >= 0).any():
            return None
        faulty = self.config.faulty
        return FaultyUploads(
            self.fault, faulty.scale, faulty.scaled_factor, faulty.flip_factor, faulty.alie_z
        )

    def _drift_events(self, index: int, entry: DriftConfig, rounds: int) -> list[DriftEvent]:
        events = []
        for rnd in entry.schedule(rounds):
            if entry.clients == "random":
                present = np.flatnonzero(self.present(rnd))
                if not len(present):
                    continue
                rng = numpy_rng(self.seed, "scenario/drift-client", index, rnd)
                clients = [int(rng.choice(present))]
            else:
                field = "scenario.drift.clients"
                clients = [_client(c, self.n_clients, field) for c in entry.clients]
            events += [
                DriftEvent(
                    round=rnd,
                    client=c,
                    kind=entry.kind,
                    seed=derive_seed(self.seed, "scenario/drift", index, rnd, c),
                    angle=entry.angle,
                    labels=entry.labels,
                    alpha=entry.alpha,
                    regroup=tuple(sorted((entry.regroup or {}).items())),
                )
                for c in clients
            ]
        return events


def _client(client: int, n_clients: int, field: str) -> int:
    if not 0 <= client < n_clients:
        raise ConfigError(
            f"{field}: client {client} does not exist (the federation has {n_clients} clients)"
        )
    return int(client)


def join_rounds(joins: JoinsConfig, n_clients: int) -> np.ndarray:
    """The round at which each client joins (1: present from the start)."""
    out = np.ones(n_clients, dtype=np.int64)
    rounds = list(joins.rounds)
    if joins.every is not None and joins.count is not None:
        first = joins.first if joins.first is not None else joins.every
        rounds = [first + (i // joins.size) * joins.every for i in range(joins.count)]
    if len(rounds) > n_clients:
        raise ConfigError(
            f"scenario.joins: {len(rounds)} late clients but the federation has {n_clients}"
        )
    late = list(range(n_clients - len(rounds), n_clients))
    out[late] = rounds
    for client, rnd in joins.at.items():
        c = _client(client, n_clients, "scenario.joins.at")
        if c in late:
            raise ConfigError(f"scenario.joins.at: client {c} is also one of the last clients")
        out[c] = rnd
    return out


def flip_labels(federation: Federation, clients: np.ndarray) -> Federation:
    """``federation`` with the training labels of ``clients`` mapped y → C−1−y.

    Only the label tensor is copied (the samples are shared): the attackers'
    own training data is poisoned where they train, as a malicious node would
    relabel its own data; test labels stay true (their honest accuracy is not
    reported anyway).
    """
    y = federation.y_train.clone()
    for c in clients:
        part = federation.client_slice(int(c))
        y[part] = federation.n_classes - 1 - y[part]
    return replace(federation, y_train=y)


def alie_z(n: int, attackers: int) -> float:
    """Baruch et al.'s z_max for ``n`` workers of which ``attackers`` collude (NeurIPS 2019).

    s = ⌊n/2 + 1⌋ − m workers must be swayed; z_max = Φ⁻¹((n − s)/n), the
    largest deviation that stays closer to the mean than s honest workers. With
    a majority of attackers (s ≤ 0) s is taken as 1.
    """
    s = max(n // 2 + 1 - attackers, 1)
    return NormalDist().inv_cdf((n - s) / n)


def faulty_clients(share: float, kinds: Sequence[str], n_clients: int, seed: int) -> np.ndarray:
    """Per client, the index in :data:`FAULTS` of its fault, or −1 for a sound client."""
    fault = np.full(n_clients, -1, dtype=np.int64)
    chosen = numpy_rng(seed, "scenario/faulty").permutation(n_clients)[: round(share * n_clients)]
    for i, c in enumerate(chosen):
        fault[c] = FAULTS.index(kinds[i % len(kinds)])
    return fault


class FaultyUploads:
    """An :data:`~fedcluster.algorithms.base.UploadTransform`: faulty clients corrupt uploads.

    ``nan`` / ``inf``: the whole uploaded model is NaN / +Inf; ``huge``: the
    update is multiplied by ``scale`` (w_start + scale·(w − w_start));
    ``scaled``: the update multiplied by ``scaled_factor`` (finite and, at
    e.g. 10, under the server's norm bound: a boosted update); ``sign_flip``:
    the update multiplied by −``flip_factor`` (the sign-flipping attack of
    the Byzantine-robustness literature); ``alie``: start + μ − z·σ, μ and σ
    the coordinate-wise mean and standard deviation of the sound clients'
    updates among those asked (all updates where fewer than two are sound),
    z = ``alie_z`` or :func:`alie_z` of the clients asked and the ``alie``
    clients among them (Baruch et al., NeurIPS 2019); ``label_flip`` rows pass
    unchanged (the attack is in the data, :func:`flip_labels`). Sound clients'
    rows pass unchanged.
    """

    def __init__(
        self,
        fault: np.ndarray,
        scale: float,
        scaled_factor: float = 10.0,
        flip_factor: float = 1.0,
        z: float | None = None,
    ) -> None:
        self.fault = fault
        self.scale = scale
        self.factors = {"huge": scale, "scaled": scaled_factor, "sign_flip": -flip_factor}
        self.z = z

    def __call__(
        self, clients: np.ndarray, start: torch.Tensor, trained: torch.Tensor, rnd: int
    ) -> torch.Tensor:
        fault = self.fault[np.asarray(clients, dtype=np.int64)]
        if (fault < 0).all():
            return trained
        out = trained.clone()
        out[torch.as_tensor(fault == FAULTS.index("nan"))] = float("nan")
        out[torch.as_tensor(fault == FAULTS.index("inf"))] = float("inf")
        for kind, factor in self.factors.items():
            hit = torch.as_tensor(fault == FAULTS.index(kind))
            out[hit] = start[hit] + factor * (trained[hit] - start[hit])
        colluding = torch.as_tensor(fault == FAULTS.index("alie"))
        if colluding.any():
            sound = torch.as_tensor(fault < 0)
            known = sound if int(sound.sum()) >= 2 else torch.ones_like(sound)
            updates = (trained[known] - start[known]).double()
            z = self.z if self.z is not None else alie_z(len(fault), int(colluding.sum()))
            sent = updates.mean(dim=0) - z * updates.std(dim=0)
            out[colluding] = start[colluding] + sent.to(trained.dtype)
        return out
