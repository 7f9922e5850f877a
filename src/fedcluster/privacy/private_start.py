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
from typing import Any

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

    assign: np.ndarray
    """Each client's group [n] (nearest final centre)."""
    updates: torch.Tensor
    """Each group's released mean clipped update [K, d]."""
    centres: torch.Tensor
    """The final released centres [K, r]."""


def sketch_updates(updates: torch.Tensor, matrix: torch.Tensor, clip: float) -> torch.Tensor:
    """s_i = clip(P·clip(u_i, C), C) for ``updates`` [n, d] and P = ``matrix`` [k, d]."""
    return clip_rows(clip_rows(updates, clip) @ matrix.T, clip)


def analyze_gauss(
    sketches: torch.Tensor, clip: float, noise_multiplier: float, gen: torch.Generator, r: int
) -> torch.Tensor:
    """The top ``r`` eigenvectors [k, r] (largest eigenvalue first) of Σ s_i s_iᵀ + E, E
    symmetric with upper triangle N(0, z²C⁴) (Dwork et al. 2014, Alg. 1)."""
    k = sketches.shape[1]
    s = sketches.double()
    noise = gaussian_noise((k, k), noise_multiplier * clip**2, gen).double().triu()
    matrix = s.T @ s + noise + noise.triu(1).T
    _, vectors = torch.linalg.eigh(matrix)
    return vectors[:, -r:].flip(1).float()


def grid_histogram(
    coords: torch.Tensor, clip: float, cells: int, noise_multiplier: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cell centres [g^r, r] of a grid of ``cells`` per axis over [−C, C]^r and the
    noisy count of ``coords`` [n, r] in each (noise N(0, z²), sensitivity 1)."""
    r = coords.shape[1]
    width = 2.0 * clip / cells
    index = ((coords + clip) / width).floor().long().clamp(0, cells - 1)
    flat = (index * cells ** torch.arange(r - 1, -1, -1)).sum(dim=1)
    counts = torch.bincount(flat, minlength=cells**r).float()
    counts += gaussian_noise(counts.shape, noise_multiplier, gen)
    axis = -clip + width * (torch.arange(cells, dtype=torch.float32) + 0.5)
    centres = torch.tensor(list(itertools.product(axis.tolist(), repeat=r)), dtype=torch.float32)
    return centres, counts


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


def nearest(coords: torch.Tensor, centres: torch.Tensor) -> np.ndarray:
    """Each row's nearest centre (the lowest index on ties): the device's assignment."""
    return torch.cdist(coords.double(), centres.double()).argmin(dim=1).numpy()


def lloyd_step(
    coords: torch.Tensor,
    centres: torch.Tensor,
    clip: float,
    noise_multiplier: float,
    gen: torch.Generator,
) -> tuple[torch.Tensor, np.ndarray]:
    """One DP-Lloyd iteration: the clients' assignments [n] to ``centres`` [K, r] and the new
    centres from the noisy (sum, C·count) of each cluster (noise N(0, 2z²C²) on each)."""
    assign = nearest(coords, centres)
    k, r = centres.shape
    onehot = torch.zeros(len(coords), k)
    onehot[torch.arange(len(coords)), torch.as_tensor(assign)] = 1.0
    released = torch.cat([onehot.T @ coords, clip * onehot.sum(dim=0, keepdim=True).T], dim=1)
    released += gaussian_noise(released.shape, noise_multiplier * clip * 2**0.5, gen)
    counts = released[:, r] / clip
    filled = counts >= 1.0
    new = centres.clone()
    new[filled] = released[filled, :r] / counts[filled].unsqueeze(1)
    return new, assign


def group_updates(
    updates: torch.Tensor,
    assign: np.ndarray,
    k: int,
    clip: float,
    noise_multiplier: float,
    gen: torch.Generator,
) -> torch.Tensor:
    """Each group's (Σ clip(u_i, C) + N(0, z²C²·I)) / n_k [K, d]; zeros for an empty group."""
    clipped = clip_rows(updates, clip)
    out = torch.zeros(k, updates.shape[1])
    for group in range(k):
        members = torch.as_tensor(assign == group)
        if not bool(members.any()):
            continue
        total = clipped[members].sum(dim=0)
        total += gaussian_noise(total.shape, noise_multiplier * clip, gen)
        out[group] = total / int(members.sum())
    return out


def private_start(
    updates: torch.Tensor,
    matrix: torch.Tensor,
    k: int,
    params: PrivateStart,
    clip: float,
    noise_multiplier: float,
    seed: int,
) -> StartResult:
    """The private start (module docstring) on the clients' first updates [n, d], with the
    public projection ``matrix`` [k', d]; noise from ``torch_rng(seed, "private-start/…")``."""
    r = params.dims or min(2 * k, matrix.shape[0])
    m = min(params.seed_dims, r)
    if r > matrix.shape[0]:
        raise ConfigError(
            f"private_start.dims: {r} principal directions need sketch_dim >= {r}, "
            f"got {matrix.shape[0]}"
        )
    if params.grid**m > MAX_CELLS:
        raise ConfigError(
            f"private_start.grid: {params.grid}^{m} histogram cells exceed {MAX_CELLS:,}; "
            "lower grid or seed_dims"
        )
    sketches = sketch_updates(updates, matrix, clip)
    basis = analyze_gauss(sketches, clip, noise_multiplier, torch_rng(seed, "private-start/pca"), r)
    coords = sketches @ basis
    cells, counts = grid_histogram(
        coords[:, :m],
        clip,
        params.grid,
        noise_multiplier,
        torch_rng(seed, "private-start/histogram"),
    )
    seeds = seed_centres(
        cells, counts, k, 3.0 * noise_multiplier, derive_seed(seed, "private-start/kmeans") % 2**32
    )
    centres = torch.cat([seeds, torch.zeros(k, r - m)], dim=1)
    for step in range(params.iterations):
        gen = torch_rng(seed, "private-start/lloyd", step)
        centres, _ = lloyd_step(coords, centres, clip, noise_multiplier, gen)
    assign = nearest(coords, centres)
    gen = torch_rng(seed, "private-start/models")
    return StartResult(
        assign, group_updates(updates, assign, k, clip, noise_multiplier, gen), centres
    )
