"""Central differential privacy at each cluster's aggregate, and privatised sketches for clustering.

Two mechanisms under which clustered FL keeps its clusters at a useful ε
(docs/privacy.md, "Central DP and sketches"; :mod:`fedcluster.privacy.mechanisms` has the
local forms):

- **Central DP per cluster aggregate** -- DP-FedAvg with adaptive clipping
  (Andrew, Thakkar, McMahan, Ramaswamy, "Differentially private learning with
  adaptive clipping", NeurIPS 2021, Alg. 1; McMahan et al., "Learning
  differentially private recurrent language models", ICLR 2018). Every
  client update u_i = w_i − w_start is clipped to the norm C_t; each
  cluster's aggregate is start + (Σ_i clip(u_i) + N(0, z_Δ²C_t²·I)) / n_k --
  the noise is added **once per cluster aggregate**, on the sum. The clip
  norm follows the γ quantile of the update norms: each participant's bit
  b_i = 1[‖u_i‖ ≤ C_t] is summed, the sum gets N(0, σ_b²), and
  C_{t+1} = C_t · exp(−η_C (b̃ − γ)) with b̃ the noisy fraction (Alg. 1;
  γ = 0.5, η_C = 0.2, σ_b = m/20 as the paper recommends). By the paper's
  Theorem 1 the two releases of a round are together one Gaussian mechanism
  of noise multiplier z = (z_Δ⁻² + (2σ_b)⁻²)^(−1/2). Neighbouring relation:
  add or remove one client; each client's update enters exactly one cluster
  sum, so the K noisy cluster sums of a round have L2 sensitivity C_t
  together (disjoint members). Threat model: a **trusted server** (or secure
  aggregation per cluster, the setting of Flower's central DP wrappers): the
  server sees the individual updates; the guarantee covers what it releases
  (the cluster models), not the server itself.
- **Privatised sketch** for the clustering step: a client's update u is
  projected by a seeded Gaussian matrix P [k, d] with N(0, 1/k) entries
  (Johnson-Lindenstrauss: E‖Pu‖² = ‖u‖²; the job's seed makes P known to the
  server), clipped to the current C_t and released with N(0, z_s²C_t²·I_k)
  on the client: local DP (the server is the adversary) with sensitivity
  C_t, a Gaussian mechanism at sample rate 1 (the server knows who sent it).
  Each client releases a sketch with its first ``sketch_releases`` uploads;
  the server clusters on the mean of a client's sketches (post-processing).
  Cluster labels found from the sketches are DP outputs, so the cluster
  sizes n_k the aggregates divide by are public.

Accounting (Opacus' RDP accountant, ``opacus.accountants``): per client, the
history [(z, q, aggregate releases), (z_s, 1, sketch releases), (z_r, 1,
private start releases)], with q the participation rate; composed by RDP and
converted at δ. Calibration finds the largest total precision P = A/z² +
S/z_s² + R/z_r² (A aggregate releases, S sketches and R releases of the
private start, :mod:`fedcluster.privacy.private_start`, budgeted) whose
history spends at most ε, and gives the sketches the share ``sketch_share``
and the start ``start_share`` of it (binary search; each ε is Opacus'). Simulation only:
the sketch is computed beside the server from the upload (the same numbers a
client would send), and the trusted aggregation is the server's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedcluster.errors import ConfigError
from fedcluster.privacy.mechanisms import _opacus, _quiet, clip_rows, gaussian_noise
from fedcluster.rng import torch_rng

if TYPE_CHECKING:
    from fedcluster.config.schema import ExperimentConfig

CENTRAL_ALGORITHMS = frozenset(
    {"fedavg", "fedprox", "fedavg-ft", "local", "ifca", "dcfl", "fedgroup", "fedgrouprox"}
)
"""Algorithms whose released models central DP covers: each client's update enters one
aggregate, and its cluster depends only on its own data and released models (IFCA's
choice) or on the noisy sketches (DCFL, FedGroup). So does any algorithm whose device
makes the choice (``choice_on_device: true``: JGL's eq. 4 on the device, from the
released models and their released steps Δw_k; FeSEM's E-step against the released
centres; DCFL's eq. 6 and FedGroup's eq. 9 against the released cluster steps, without
sketches). The others cluster on individual updates or gradients (CFL, FL+HC, CFLGT,
FeSEM's and JGL's server-side choices) and are refused."""

SECURE_CLUSTERED = frozenset({"ifca", "jgl", "dcfl", "fedgroup", "fedgrouprox"})
"""Clustered algorithms that run under secure aggregation (``privacy.secure_aggregation``)
with ``choice_on_device: true``: the device chooses among the released models, so the
server needs nothing but each cluster's sum (:mod:`fedcluster.protocol.secure_sum`)."""
SECURE_GLOBAL = frozenset({"fedavg", "fedprox", "fedavg-ft"})
"""DP-FedAvg and its variants: one sum of all clipped updates."""

_NEEDS_INDIVIDUAL_UPLOADS = {
    "shared_layers": "shared layers are averaged over all clients' rows",
    "repair": "repair splits a cluster by its members' updates",
    "min_cluster_share": "the good initializer counts each client's choice",
    "empty_cluster_fix": "it pins devices by their last cluster, which the server does not learn",
}


def planned_steps(config: ExperimentConfig, n_clients: int) -> int:
    """The aggregate steps a client's budget plans: ``max_participations``, and under
    sampling (q < 1) at least one per round, since every round is a step of every
    client's ledger (:meth:`CentralDP.aggregate_steps`)."""
    from fedcluster.privacy.ledger import max_participations, participation_rate

    uploads = max_participations(config, n_clients)
    if participation_rate(config, n_clients) < 1.0:
        return max(uploads, config.rounds)
    return uploads


def check_secure_aggregation(config: ExperimentConfig) -> None:
    """With ``privacy.secure_aggregation``, refuse what it cannot serve before anything
    runs, one line naming the setting: a mode other than central, an algorithm outside
    :data:`SECURE_GLOBAL` or :data:`SECURE_CLUSTERED` with the choice on the device,
    settings that need individual uploads or assignments (JGL's ``empty_cluster_fix`` is
    on unless set to false), simulated faults that garble uploads."""
    if not config.privacy.secure_aggregation:
        return
    if config.privacy.mode != "central":
        raise ConfigError(
            "privacy.secure_aggregation: needs privacy.mode: central (the server adds "
            "the noise to the sums it receives)"
        )
    for a in config.algorithms:
        where = f"algorithm {a.display_name()!r}"
        if a.name in SECURE_GLOBAL:
            continue
        if a.name not in SECURE_CLUSTERED or not a.params.get("choice_on_device"):
            raise ConfigError(
                f"privacy.secure_aggregation: not available for {where}; it needs "
                f"{', '.join(sorted(SECURE_GLOBAL))}, or "
                f"{', '.join(sorted(SECURE_CLUSTERED))} with choice_on_device: true"
            )
        for key, why in _NEEDS_INDIVIDUAL_UPLOADS.items():
            value = a.params.get(key)
            on_by_default = key == "empty_cluster_fix" and a.name == "jgl"
            if value not in (None, False, 0, 0.0) or (on_by_default and value is None):
                raise ConfigError(
                    f"privacy.secure_aggregation: {where} sets {key} ({why}); "
                    f"{'set it to false' if key == 'empty_cluster_fix' else 'leave it out'}"
                )
    garbled = set(config.scenario.faulty.kinds) - {"label_flip"}
    if config.scenario.faulty.share > 0 and garbled:
        raise ConfigError(
            "privacy.secure_aggregation: scenario.faulty garbles uploads the server never "
            f"sees ({', '.join(sorted(garbled))}); only label_flip applies"
        )


History = Sequence[tuple[float, float, int]]
"""Gaussian mechanisms released: ``(noise multiplier, sample rate, steps)``."""


# ---------------------------------------------------------------- accounting
def composed_epsilon(history: History, delta: float) -> float:
    """ε at δ of the RDP composition of ``history`` (Opacus ``RDPAccountant``)."""
    history = [(float(z), float(q), int(n)) for z, q, n in history if n > 0]
    if not history:
        return 0.0
    if any(z <= 0.0 for z, _, _ in history):
        return math.inf
    return _composed_epsilon(tuple(history), float(delta))


@lru_cache(maxsize=65536)
def _composed_epsilon(history: tuple[tuple[float, float, int], ...], delta: float) -> float:
    acc = _opacus().create_accountant(mechanism="rdp")
    acc.history = list(history)
    with _quiet():
        return float(acc.get_epsilon(delta=delta))


def split_noise(
    precision: float,
    aggregates: int,
    sketches: int,
    share: float,
    starts: int = 0,
    start_share: float = 0.0,
) -> tuple[float, float, float]:
    """``(z, z_s, z_r)`` giving the sketches ``share`` and the private start ``start_share``
    of the total precision A/z² + S/z_s² + R/z_r² (the aggregates the rest)."""
    sketch_part = share if sketches else 0.0
    start_part = start_share if starts else 0.0
    rest = 1.0 - sketch_part - start_part
    z = math.sqrt(aggregates / (rest * precision)) if aggregates else 0.0
    z_s = math.sqrt(sketches / (sketch_part * precision)) if sketches else 0.0
    z_r = math.sqrt(starts / (start_part * precision)) if starts else 0.0
    return z, z_s, z_r


@lru_cache(maxsize=256)
def calibrate_central(
    epsilon: float,
    delta: float,
    sample_rate: float,
    aggregates: int,
    sketches: int = 0,
    share: float = 0.5,
    starts: int = 0,
    start_share: float = 0.0,
) -> tuple[float, float, float]:
    """``(z, z_s, z_r)``: noise multipliers with which ``aggregates`` releases at rate q,
    ``sketches`` releases at rate 1 and the private start's ``starts`` releases at rate 1
    compose to at most (ε, δ) (module docstring).

    With neither sketches nor a start this is Opacus' ``get_noise_multiplier`` for the
    aggregates alone.
    """
    if sketches == 0 and starts == 0:
        with _quiet():
            z = _opacus().get_noise_multiplier(
                target_epsilon=epsilon,
                target_delta=delta,
                sample_rate=sample_rate,
                steps=aggregates,
                accountant="rdp",
            )
        return float(z), 0.0, 0.0

    def eps(precision: float) -> float:
        z, z_s, z_r = split_noise(precision, aggregates, sketches, share, starts, start_share)
        return composed_epsilon(
            [(z, sample_rate, aggregates), (z_s, 1.0, sketches), (z_r, 1.0, starts)], delta
        )

    low, high = 1e-6, 1.0
    while eps(high) < epsilon:
        low, high = high, high * 4.0
    while high - low > 1e-4 * high:  # ε grows with the precision
        mid = (low + high) / 2
        low, high = (mid, high) if eps(mid) <= epsilon else (low, mid)
    return split_noise(low, aggregates, sketches, share, starts, start_share)


def update_noise_multiplier(noise_multiplier: float, count_noise: float) -> float:
    """z_Δ of the clipped sum, so that it and the unclipped count of noise σ_b make one
    Gaussian mechanism of multiplier z (Andrew et al. 2021, Theorem 1):
    z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2)."""
    rest = noise_multiplier**-2 - (2.0 * count_noise) ** -2
    if rest <= 0.0:
        raise ConfigError(
            f"privacy.count_noise: σ_b = {count_noise:g} is too small for the noise "
            f"multiplier {noise_multiplier:.3g} (needs 2σ_b > z); raise it"
        )
    return rest**-0.5


# ------------------------------------------------------------------- sketch
def projection(seed: int, dim: int, k: int) -> torch.Tensor:
    """The shared sketch matrix P [k, d]: N(0, 1/k) entries from the job's seed."""
    gen = torch_rng(seed, "dp/sketch-projection")
    return gaussian_noise((k, dim), 1.0 / math.sqrt(k), gen)


def release_sketch(
    updates: torch.Tensor,
    matrix: torch.Tensor,
    clip: float,
    noise_multiplier: float,
    generators: Sequence[torch.Generator],
) -> torch.Tensor:
    """Noisy sketches [n, k] of ``updates`` [n, d]: clip(P·u_i, C) + N(0, z_s²C²·I_k).

    L2 sensitivity C under add/remove-one-client (the clip bounds every
    sketch; its neighbour releases nothing), whatever P is.
    """
    sketches = clip_rows(updates @ matrix.T, clip)
    for i, gen in enumerate(generators):
        sketches[i] += gaussian_noise(sketches.shape[1:], noise_multiplier * clip, gen)
    return sketches


# ---------------------------------------------------------------- mechanism
@dataclass
class CentralDP:
    """A job's central DP (module docstring): the aggregator every algorithm calls per
    cluster, the adaptive clip norm, the sketches and the per-client ledger.

    Installed as ``Context.aggregate`` and ``Context.central``; the runner calls
    :meth:`start_round` and :meth:`end_round` around every round, and
    ``Context.exchange`` calls :meth:`observe` with every accepted training upload.
    """

    n_clients: int
    seed: int
    delta: float
    noise_multiplier: float
    """z of one aggregate release (clipped sum and unclipped count together)."""
    count_noise: float
    """σ_b of the unclipped count."""
    sample_rate: float
    clip: float
    """C_t, the clip norm in force."""
    target_quantile: float = 0.5
    clip_lr: float = 0.2
    sketch_matrix: torch.Tensor | None = None
    sketch_noise: float = 0.0
    sketch_releases: int = 0
    target_epsilon: float | None = None
    start_noise: float = 0.0
    """z_r of each release of the private start (:mod:`fedcluster.privacy.private_start`)."""
    start_releases: int = 0
    """Releases of the private start each client present at the start enters."""

    def __post_init__(self) -> None:
        self.update_noise = update_noise_multiplier(self.noise_multiplier, self.count_noise)
        self.releases = np.zeros(self.n_clients, dtype=np.int64)
        self.sketched = np.zeros(self.n_clients, dtype=np.int64)
        self.started = np.zeros(self.n_clients, dtype=np.int64)
        k = 0 if self.sketch_matrix is None else len(self.sketch_matrix)
        self.sketch_sum = torch.zeros(self.n_clients, k)
        self.round = 0
        self.calls = 0
        self.aggregate_rounds = 0
        """Rounds that released aggregates (the steps of a sampled client's ledger)."""
        self._bits: dict[int, bool] = {}
        self._summed_bits: list[float] = [0.0, 0]

    @classmethod
    def from_config(
        cls, config: ExperimentConfig, n_clients: int, dim: int, seed: int, starts: int = 0
    ) -> CentralDP | None:
        """The job's central DP from the ``privacy`` section (None unless ``mode: central``);
        ``starts``: the releases of the job's private start (0: none)."""
        from fedcluster.privacy.ledger import participation_rate

        p = config.privacy
        if p.mode != "central":
            if p.sketch_dim:
                raise ConfigError("privacy.sketch_dim: sketches need privacy.mode: central")
            return None
        refused = sorted(
            {
                a.name
                for a in config.algorithms
                if a.name not in CENTRAL_ALGORITHMS and not a.params.get("choice_on_device")
            }
        )
        if refused:
            raise ConfigError(
                f"privacy.mode central: not available for {', '.join(refused)} (they cluster "
                f"on individual uploads); allowed: {', '.join(sorted(CENTRAL_ALGORITHMS))}, "
                "and JGL, FeSEM, DCFL or FedGroup with choice_on_device: true (the device "
                "chooses from the released models)"
            )
        if p.accountant != "rdp":
            raise ConfigError("privacy.accountant: central DP composes with RDP; use rdp")
        if config.aggregation.rule != "mean":
            raise ConfigError(
                "aggregation.rule: central DP is its own clipped mean; got "
                f"{config.aggregation.rule!r}, use mean"
            )
        uploads = planned_steps(config, n_clients)
        q = participation_rate(config, n_clients)
        sketches = min(p.sketch_releases, uploads) if p.sketch_dim else 0
        if sketches and starts and p.sketch_share + p.start_share >= 1.0:
            raise ConfigError(
                f"privacy.start_share: {p.start_share:g} with sketch_share "
                f"{p.sketch_share:g} leaves nothing for the aggregates; their sum must be < 1"
            )
        z, z_s, z_r = calibrate_central(
            p.epsilon, p.delta, q, uploads, sketches, p.sketch_share, starts, p.start_share
        )
        count_noise = p.count_noise if p.count_noise is not None else q * n_clients / 20.0
        return cls(
            n_clients,
            seed,
            p.delta,
            z,
            count_noise,
            q,
            p.clip,
            p.target_quantile,
            p.clip_lr,
            projection(seed, dim, p.sketch_dim) if p.sketch_dim else None,
            z_s,
            sketches,
            p.epsilon,
            z_r,
            starts,
        )

    # ------------------------------------------------------------- rounds
    def start_round(self, rnd: int) -> None:
        self.round = rnd
        self.calls = 0
        self._bits = {}
        self._summed_bits = [0.0, 0]

    def end_round(self) -> None:
        """Count the round if it released aggregates; C_{t+1} = C_t·exp(−η_C(b̃ − γ)) from
        the round's noisy unclipped fraction (Alg. 1)."""
        self.aggregate_rounds += int(self.calls > 0)
        m = len(self._bits) + self._summed_bits[1]
        if m == 0:
            return
        gen = torch_rng(self.seed, "dp/central-count", self.round)
        bits = sum(self._bits.values()) + self._summed_bits[0]
        noisy = bits + float(gaussian_noise((1,), self.count_noise, gen))
        self.clip *= math.exp(-self.clip_lr * (noisy / m - self.target_quantile))

    def observe(self, clients: np.ndarray, start: torch.Tensor, rows: torch.Tensor) -> None:
        """Enter accepted training uploads: one aggregate release each in the ledger, the
        unclipped bit (one per client and round), and the client's sketch while it has
        sketch releases left."""
        updates = rows - (start.expand_as(rows) if start.dim() == 1 else start)
        norms = updates.norm(dim=1)
        for c, norm in zip(clients.tolist(), norms.tolist(), strict=True):
            self._bits[int(c)] = norm <= self.clip
        self.releases[clients] += 1
        if self.sketch_matrix is None:
            return
        due = self.sketched[clients] < self.sketch_releases
        if not due.any():
            return
        who = clients[due]
        gens = [
            torch_rng(self.seed, "dp/sketch", self.round, int(c), int(self.sketched[c]))
            for c in who
        ]
        sketches = release_sketch(
            updates[torch.as_tensor(due)], self.sketch_matrix, self.clip, self.sketch_noise, gens
        )
        self.sketch_sum[torch.as_tensor(who)] += sketches
        self.sketched[who] += 1

    def observe_sum(self, clients: np.ndarray, unclipped: float, n: int) -> None:
        """Enter a secure sum's contributors: one aggregate release each in the ledger, and
        the sum's count of unclipped updates among its ``n`` (the only bits the server sees)."""
        self.releases[clients] += 1
        self._summed_bits[0] += unclipped
        self._summed_bits[1] += n

    def sketches(self, clients: np.ndarray) -> torch.Tensor:
        """Each client's mean released sketch [n, k] (zeros for one that has released none)."""
        count = torch.as_tensor(np.maximum(self.sketched[clients], 1), dtype=torch.float32)
        return self.sketch_sum[torch.as_tensor(clients)] / count.unsqueeze(1)

    def project(self, rows: torch.Tensor) -> torch.Tensor:
        """Public vectors [n, d] (e.g. cluster directions) in sketch space [n, k]."""
        assert self.sketch_matrix is not None
        return rows @ self.sketch_matrix.T

    # --------------------------------------------------------- aggregation
    def __call__(
        self, start: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One cluster's aggregate: mean start + (Σ clip(u_i, C_t) + N(0, z_Δ²C_t²)) / n.

        Uniform over members (``weights`` are ignored: a sample count would be
        an unbounded, unprotected weight). The noise is drawn once per call from
        ``torch_rng(seed, "dp/central", round, call)``.
        """
        base = start.expand_as(rows) if start.dim() == 1 else start
        total = clip_rows(rows - base, self.clip).sum(dim=0)
        return self.release_sum(base.mean(dim=0), total, len(rows))

    def release_sum(self, start: torch.Tensor, total: torch.Tensor, n: int) -> torch.Tensor:
        """One cluster's aggregate from its sum of clipped updates ``total`` [d] over ``n``
        members (a trusted server's, or a secure aggregation's): start + (total + noise) / n,
        the noise drawn as :meth:`__call__` draws it."""
        total = total.to(torch.float32, copy=True)
        gen = torch_rng(self.seed, "dp/central", self.round, self.calls)
        self.calls += 1
        total += gaussian_noise(total.shape, self.update_noise * self.clip, gen)
        return start + total / n

    def record_start(self, clients: np.ndarray) -> None:
        """Enter the private start's releases for the ``clients`` that took part."""
        self.started[clients] += self.start_releases

    # ---------------------------------------------------------- accounting
    def aggregate_steps(self) -> np.ndarray:
        """Each client's aggregate steps in the ledger: its releases under full
        participation; under sampling (q < 1) every round that released aggregates, taken
        part or not, since amplification by sampling prices each round's mechanism over
        the chance of being in it (Opacus counts a step for every sample alike)."""
        if self.sample_rate >= 1.0:
            return self.releases
        return np.maximum(self.releases, self.aggregate_rounds)

    def epsilons(self) -> np.ndarray:
        """ε spent so far by every client: its aggregate steps, sketches and private start's
        releases composed by RDP."""
        return np.array(
            [
                composed_epsilon(
                    [
                        (self.noise_multiplier, self.sample_rate, int(a)),
                        (self.sketch_noise, 1.0, int(s)),
                        (self.start_noise, 1.0, int(r)),
                    ],
                    self.delta,
                )
                for a, s, r in zip(self.aggregate_steps(), self.sketched, self.started, strict=True)
            ]
        )

    def max_epsilon(self) -> float:
        """The largest ε spent over clients (the ``epsilon`` column)."""
        return float(self.epsilons().max()) if self.n_clients else 0.0

    def exhausted(self) -> bool:
        """Central DP never withholds uploads: the budget plans ``max_participations``."""
        return False

    def state_dict(self) -> dict[str, Any]:
        return {
            "releases": self.releases.tolist(),
            "sketched": self.sketched.tolist(),
            "started": self.started.tolist(),
            "sketch_sum": self.sketch_sum.tolist(),
            "clip": self.clip,
            "aggregate_rounds": self.aggregate_rounds,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None:
            return
        self.releases = np.asarray(state["releases"], dtype=np.int64).copy()
        self.sketched = np.asarray(state["sketched"], dtype=np.int64).copy()
        self.started = np.asarray(state["started"], dtype=np.int64).copy()
        self.sketch_sum = torch.as_tensor(state["sketch_sum"], dtype=torch.float32).reshape(
            self.sketch_sum.shape
        )
        self.clip = float(state["clip"])
        self.aggregate_rounds = int(state.get("aggregate_rounds", 0))
