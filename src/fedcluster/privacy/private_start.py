"""A private start for clustered FL: DP clustering of the clients' first updates.

Before round 1 every present client trains once from the common initial
model w0; its update u_i is clipped to C, projected to k dimensions by the
job's public seeded matrix P (:func:`fedcluster.privacy.central.projection`)
and clipped to C again: s_i = clip(P·clip(u_i, C), C). The server then finds
K groups with releases that are each one Gaussian mechanism of noise
multiplier z (sample rate 1) under add/remove-one-client:

1. **DP-PCA, "Analyze Gauss"** (Dwork, Talwar, Thakurta, Zhang, "Analyze
   Gauss: optimal bounds for privacy-preserving principal component
   analysis", STOC 2014, Alg. 1): M = Σ_i s_i s_iᵀ + E with E symmetric, its
   upper triangle N(0, z²C⁴) and mirrored (L2 sensitivity ‖s sᵀ‖_F = ‖s‖² ≤
   C²); the top r eigenvectors V [k, r] of M are released and every client
   has coordinates e_i = Vᵀ s_i, ‖e_i‖ ≤ C. The second moment is not
   centred: its top direction is the updates' common part, and the groups
   differ along the next ones, hence r = 2K by default.
2. **Initial centres**: a noisy histogram of the leading m coordinates of
   the e_i on a grid of g cells per axis over [−C, C]^m (sensitivity 1: a
   client adds one to one cell; noise N(0, z²)); cells below 3z are dropped,
   and k-means with k-means++ seeding and the noisy counts as sample weights
   (scikit-learn's ``KMeans``) picks K centres among the cell centres --
   post-processing of the released histogram. Their other r − m coordinates
   are 0 (the histogram stays small: g^m cells).
3. **DP-Lloyd** (Blum, Dwork, McSherry, Nissim, "Practical privacy: the SuLQ
   framework", PODS 2005, Sec. 5; Su, Cao, Li, Bertino, Lin, Xiao,
   "Differentially private k-means clustering", CODASPY 2016, Sec. 3): each
   client assigns itself to the nearest released centre (on the device), and
   the server releases per cluster the noisy sum Σ e_i and the noisy scaled
   count C·n_k together: one client changes one cluster's (sum, C·count) by a
   vector of norm at most √2·C, so noise N(0, 2z²C²) on every coordinate is
   one Gaussian mechanism of multiplier z. The new centre is sum / count
   (a cluster whose noisy count is below 1 keeps its centre). T iterations.
4. **The K models**: each client takes the nearest final centre, and model k
   is w0 + (Σ_{i∈k} clip(u_i, C) + N(0, z²C²·I)) / n_k: the clusters are
   disjoint, so the K sums are one release of sensitivity C.

That is T + 3 releases (:func:`start_releases`), each at multiplier z, which
central DP composes with its training releases by RDP
(:meth:`fedcluster.privacy.central.CentralDP.epsilons`;
``privacy.start_share`` of the budget's precision). Without DP z = 0 and the
same pipeline runs noise-free. Simulation only: the sketches, the
assignments and the sums are computed beside the server from the clients'
uploads (the same numbers the devices would send); the threat model is
central DP's trusted server.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from sklearn.cluster import KMeans

from fedcluster.errors import ConfigError
from fedcluster.privacy.mechanisms import clip_rows, gaussian_noise
from fedcluster.rng import derive_seed, torch_rng

MAX_CELLS = 1_000_000
"""The largest histogram (g^r cells) the start releases."""


class PrivateStart(BaseModel):
    """Parameters of the private start (``init: private``; module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dims: int | None = Field(
        None, ge=1, description="r, the principal directions released (None: 2K)"
    )
    seed_dims: int = Field(
        2, ge=1, description="m, the leading directions of the histogram that seeds the centres"
    )
    iterations: int = Field(5, ge=1, description="T, the DP-Lloyd iterations")
    sketch_dim: int = Field(32, ge=1, description="k, the projected update's dimension")
    grid: int = Field(6, ge=2, description="g, histogram cells per principal axis")
    clip: float = Field(1.0, gt=0.0, description="C without central DP (under it: privacy.clip)")

    @property
    def releases(self) -> int:
        """Gaussian releases of the start: the PCA, the histogram, T Lloyd steps, the models."""
        return start_releases(self.iterations)


def private_start_field() -> Any:
    """The ``private_start`` field of an algorithm's params (``init: private``)."""
    return Field(default_factory=PrivateStart, description="the private start's parameters")


def start_releases(iterations: int) -> int:
    """The start's Gaussian releases with T = ``iterations`` (module docstring)."""
    return iterations + 3


def planned_start_releases(params: Mapping[str, Any]) -> int:
    """Releases an algorithm's raw parameters plan for the start (0 unless ``init: private``)."""
    if params.get("init") != "private":
        return 0
    return PrivateStart.model_validate(params.get("private_start") or {}).releases


@dataclass(frozen=True)
class StartResult:
    """What the private start found."""

    sizes: np.ndarray
    """The clients in each group [K] (nearest final centre)."""
    updates: torch.Tensor
    """Each group's released mean clipped update [K, d]."""
    centres: torch.Tensor
    """The final released centres [K, r]."""
    basis: torch.Tensor
    """The released principal directions V [k, r]."""


def sketch_updates(updates: torch.Tensor, matrix: torch.Tensor, clip: float) -> torch.Tensor:
    """s_i = clip(P·clip(u_i, C), C) for ``updates`` [n, d] and P = ``matrix`` [k, d]."""
    return clip_rows(clip_rows(updates, clip) @ matrix.T, clip)


def nearest(coords: torch.Tensor, centres: torch.Tensor) -> np.ndarray:
    """Each row's nearest centre (the lowest index on ties): the device's assignment."""
    return torch.cdist(coords.double(), centres.double()).argmin(dim=1).numpy()


class StartStatistics(Protocol):
    """The sums over the clients that the private start releases (with noise), however
    they are gathered: from the updates themselves (:class:`UpdateStatistics`) or as the
    sums of the devices' contributions under secure aggregation."""

    @property
    def sketch_dim(self) -> int: ...

    def second_moment(self) -> torch.Tensor:
        """Σ s_i s_iᵀ [k, k] (float64)."""
        ...

    def cell_counts(self, basis: torch.Tensor, m: int, cells: int) -> torch.Tensor:
        """The clients in each of the ``cells``^m grid cells over [−C, C]^m of their leading
        m coordinates e_i = Vᵀ s_i [g^m]."""
        ...

    def cluster_sums(self, basis: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
        """[K, r + 1]: per nearest centre, Σ e_i and C·n_k."""
        ...

    def group_sums(
        self, basis: torch.Tensor, centres: torch.Tensor
    ) -> tuple[torch.Tensor, np.ndarray]:
        """Per nearest centre, Σ clip(u_i, C) [K, d] and the group's size [K]."""
        ...


@dataclass
class UpdateStatistics:
    """:class:`StartStatistics` computed from clients' first ``updates`` [n, d] with the
    public projection ``matrix`` [k, d]: by the server that sees them, or by a device from
    its own update (n = 1: its contribution to a secure sum)."""

    updates: torch.Tensor
    matrix: torch.Tensor
    clip: float

    def __post_init__(self) -> None:
        self.sketches = sketch_updates(self.updates, self.matrix, self.clip)

    @property
    def sketch_dim(self) -> int:
        return int(self.matrix.shape[0])

    def coordinates(self, basis: torch.Tensor) -> torch.Tensor:
        """e_i = Vᵀ s_i [n, r]."""
        return self.sketches @ basis

    def second_moment(self) -> torch.Tensor:
        s = self.sketches.double()
        return s.T @ s

    def cell_counts(self, basis: torch.Tensor, m: int, cells: int) -> torch.Tensor:
        coords = self.coordinates(basis)[:, :m]
        width = 2.0 * self.clip / cells
        index = ((coords + self.clip) / width).floor().long().clamp(0, cells - 1)
        flat = (index * cells ** torch.arange(m - 1, -1, -1)).sum(dim=1)
        return torch.bincount(flat, minlength=cells**m).float()

    def cluster_sums(self, basis: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
        coords = self.coordinates(basis)
        onehot = self._onehot(nearest(coords, centres), len(centres))
        return torch.cat([onehot.T @ coords, self.clip * onehot.sum(dim=0, keepdim=True).T], dim=1)

    def group_sums(
        self, basis: torch.Tensor, centres: torch.Tensor
    ) -> tuple[torch.Tensor, np.ndarray]:
        assign = nearest(self.coordinates(basis), centres)
        clipped = clip_rows(self.updates, self.clip)
        sums = torch.zeros(len(centres), self.updates.shape[1])
        for group in np.unique(assign):
            sums[int(group)] = clipped[torch.as_tensor(assign == group)].sum(dim=0)
        return sums, np.bincount(assign, minlength=len(centres))

    def _onehot(self, assign: np.ndarray, k: int) -> torch.Tensor:
        onehot = torch.zeros(len(assign), k)
        onehot[torch.arange(len(assign)), torch.as_tensor(assign)] = 1.0
        return onehot


def basis_from(
    second_moment: torch.Tensor, clip: float, noise_multiplier: float, gen: torch.Generator, r: int
) -> torch.Tensor:
    """The top ``r`` eigenvectors [k, r] (largest eigenvalue first) of Σ s_i s_iᵀ + E, E
    symmetric with upper triangle N(0, z²C⁴) (Dwork et al. 2014, Alg. 1)."""
    k = second_moment.shape[0]
    noise = gaussian_noise((k, k), noise_multiplier * clip**2, gen).double().triu()
    matrix = second_moment.double() + noise + noise.triu(1).T
    _, vectors = torch.linalg.eigh(matrix)
    return vectors[:, -r:].flip(1).float()


def histogram_from(
    counts: torch.Tensor,
    m: int,
    clip: float,
    cells: int,
    noise_multiplier: float,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cell centres [g^m, m] of the grid of ``cells`` per axis over [−C, C]^m and the
    noisy ``counts`` [g^m] (noise N(0, z²), sensitivity 1)."""
    noisy = counts.float() + gaussian_noise(counts.shape, noise_multiplier, gen)
    width = 2.0 * clip / cells
    axis = -clip + width * (torch.arange(cells, dtype=torch.float32) + 0.5)
    centres = torch.tensor(list(itertools.product(axis.tolist(), repeat=m)), dtype=torch.float32)
    return centres, noisy


def seed_centres(
    cell_centres: torch.Tensor, counts: torch.Tensor, k: int, threshold: float, seed: int
) -> torch.Tensor:
    """K centres [K, r]: weighted k-means (k-means++ seeding) of the cells whose noisy count
    exceeds ``threshold`` (at least the K fullest cells), weighted by their counts."""
    keep = counts > threshold
    if int(keep.sum()) < k:
        keep = torch.zeros_like(keep)
        keep[counts.topk(k).indices] = True
    weights = counts[keep].clamp(min=1e-12).double().numpy()
    points = cell_centres[keep].double().numpy()
    fit = KMeans(n_clusters=k, n_init=10, random_state=seed).fit(points, sample_weight=weights)
    return torch.as_tensor(fit.cluster_centers_, dtype=torch.float32)


def lloyd_from(
    sums: torch.Tensor,
    centres: torch.Tensor,
    clip: float,
    noise_multiplier: float,
    gen: torch.Generator,
) -> torch.Tensor:
    """One DP-Lloyd iteration's new centres [K, r] from each cluster's (Σ e_i, C·n_k)
    ``sums`` [K, r + 1] with noise N(0, 2z²C²) on each entry (a cluster whose noisy count
    is below 1 keeps its centre)."""
    r = centres.shape[1]
    released = sums.float() + gaussian_noise(sums.shape, noise_multiplier * clip * 2**0.5, gen)
    counts = released[:, r] / clip
    filled = counts >= 1.0
    new = centres.clone()
    new[filled] = released[filled, :r] / counts[filled].unsqueeze(1)
    return new


def groups_from(
    sums: torch.Tensor,
    sizes: np.ndarray,
    clip: float,
    noise_multiplier: float,
    gen: torch.Generator,
) -> torch.Tensor:
    """Each group's (Σ clip(u_i, C) + N(0, z²C²·I)) / n_k [K, d] from its ``sums`` [K, d]
    and ``sizes`` [K]; zeros for an empty group."""
    out = torch.zeros(sums.shape, dtype=torch.float32)
    for group in np.flatnonzero(sizes):
        total = sums[group].float().clone()
        total += gaussian_noise(total.shape, noise_multiplier * clip, gen)
        out[group] = total / int(sizes[group])
    return out


def private_start(
    stats: StartStatistics,
    k: int,
    params: PrivateStart,
    clip: float,
    noise_multiplier: float,
    seed: int,
) -> StartResult:
    """The private start (module docstring) from the clients' ``stats`` (their first
    updates, or their sums under secure aggregation); noise from
    ``torch_rng(seed, "private-start/…")``."""
    r = params.dims or min(2 * k, stats.sketch_dim)
    m = min(params.seed_dims, r)
    if r > stats.sketch_dim:
        raise ConfigError(
            f"private_start.dims: {r} principal directions need sketch_dim >= {r}, "
            f"got {stats.sketch_dim}"
        )
    if params.grid**m > MAX_CELLS:
        raise ConfigError(
            f"private_start.grid: {params.grid}^{m} histogram cells exceed {MAX_CELLS:,}; "
            "lower grid or seed_dims"
        )
    z = noise_multiplier
    basis = basis_from(stats.second_moment(), clip, z, torch_rng(seed, "private-start/pca"), r)
    cells, counts = histogram_from(
        stats.cell_counts(basis, m, params.grid),
        m,
        clip,
        params.grid,
        z,
        torch_rng(seed, "private-start/histogram"),
    )
    seeds = seed_centres(
        cells, counts, k, 3.0 * z, derive_seed(seed, "private-start/kmeans") % 2**32
    )
    centres = torch.cat([seeds, torch.zeros(k, r - m)], dim=1)
    for step in range(params.iterations):
        gen = torch_rng(seed, "private-start/lloyd", step)
        centres = lloyd_from(stats.cluster_sums(basis, centres), centres, clip, z, gen)
    sums, sizes = stats.group_sums(basis, centres)
    updates = groups_from(sums, sizes, clip, z, torch_rng(seed, "private-start/models"))
    return StartResult(sizes, updates, centres, basis)
