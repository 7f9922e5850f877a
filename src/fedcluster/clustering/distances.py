"""Pairwise similarities and distances between clients, all pairs at once.

Every function takes one client per row (torch tensors [n, d], any floating
dtype; NumPy arrays are accepted too), computes in **float64** and returns
**float64** tensors on the input's device. Pairs come from Gram matrices
(``X @ Y.T``) and batched ``torch.cdist``; there is no Python loop over pairs.
Points are centred before a Gram expansion of squared distances, so that
models with large norms but small differences keep their precision.

Square results are exactly symmetric; distance matrices have exact zeros on
the diagonal.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from fedcluster.clustering._inputs import ArrayLike, as_rows
from fedcluster.errors import ConfigError

DcflVariant = Literal["complete", "divergence", "cosine", "euclidean"]
DCFL_VARIANTS: tuple[str, ...] = get_args(DcflVariant)


def _check_same_width(x: torch.Tensor, y: torch.Tensor, names: str) -> None:
    if x.shape[1] != y.shape[1]:
        raise ConfigError(f"{names}: row lengths differ ({x.shape[1]} vs {y.shape[1]})")


def _symmetric(m: torch.Tensor) -> torch.Tensor:
    return 0.5 * (m + m.T)


def _distance_matrix(d: torch.Tensor) -> torch.Tensor:
    """Symmetrise a pairwise distance matrix and put exact zeros on its diagonal."""
    d = _symmetric(d)
    d.fill_diagonal_(0.0)
    return d


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit norm; all-zero rows stay zero (their cosines are 0)."""
    return x / x.norm(dim=1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)


def _centred_pair(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` and ``y`` shifted by the same vector (the mean of ``x``'s rows)."""
    shift = x.mean(dim=0)
    return x - shift, y - shift


def _sq_distances_to(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``|x_i - y_j|^2`` [n, m] by Gram expansion (pass centred rows), tiny negatives clamped."""
    sq = (x * x).sum(1)[:, None] + (y * y).sum(1)[None, :] - 2.0 * (x @ y.T)
    return sq.clamp_min(0.0)


def cosine_to(u: ArrayLike, v: ArrayLike) -> torch.Tensor:
    """Cosine similarities ``cos(u_i, v_j)`` [n, m] between the rows of ``u`` and ``v``.

    FedGroup eq. 5 / eq. 6 (kernel ``K(U, V)``). A zero row has cosine 0 with
    everything. Float64, clamped to [-1, 1].
    """
    u_rows, v_rows = as_rows(u, "u"), as_rows(v, "v")
    _check_same_width(u_rows, v_rows, "u, v")
    return (_unit_rows(u_rows) @ _unit_rows(v_rows).T).clamp(-1.0, 1.0)


def cosine_similarity_matrix(u: ArrayLike) -> torch.Tensor:
    """Pairwise cosine similarities [n, n] of the rows of ``u`` (FedGroup eq. 6, Sattler's CFL).

    Float64, symmetric, in [-1, 1]; the diagonal is 1 up to rounding (0 for a
    zero row).
    """
    return _symmetric(cosine_to(u, u))


def euclidean_distance_matrix(x: ArrayLike) -> torch.Tensor:
    """Pairwise euclidean distances [n, n] between the rows of ``x``.

    Gram expansion ``|x_i|^2 + |x_j|^2 - 2<x_i, x_j>`` in float64 on centred
    rows; tiny negatives are clamped before the square root; the diagonal is
    exactly 0.
    """
    rows = as_rows(x, "x")
    centred, _ = _centred_pair(rows, rows)
    return _distance_matrix(_sq_distances_to(centred, centred).sqrt())


def _dcfl_to(
    origins_a: ArrayLike,
    ends_a: ArrayLike,
    origins_b: ArrayLike,
    ends_b: ArrayLike,
    variant: DcflVariant,
) -> torch.Tensor:
    """DCFL distances [n, m] from the update vectors of ``a`` to those of ``b`` (see below)."""
    if variant not in DCFL_VARIANTS:
        raise ConfigError(f"variant: expected one of {DCFL_VARIANTS}, got {variant!r}")
    oa, ea = as_rows(origins_a, "origins_a"), as_rows(ends_a, "ends_a")
    ob, eb = as_rows(origins_b, "origins_b"), as_rows(ends_b, "ends_b")
    if oa.shape != ea.shape or ob.shape != eb.shape:
        raise ConfigError(
            f"origins, ends: shapes differ ({tuple(oa.shape)} vs {tuple(ea.shape)}, "
            f"{tuple(ob.shape)} vs {tuple(eb.shape)})"
        )
    _check_same_width(ea, eb, "ends_a, ends_b")
    ua, ub = ea - oa, eb - ob
    if variant == "cosine":
        return 1.0 - cosine_to(ua, ub)
    ea, eb = _centred_pair(ea, eb)
    end_dist = _sq_distances_to(ea, eb).sqrt()
    if variant == "euclidean":
        return end_dist
    # <u_i - u'_j, B_i - D_j> expanded into Gram terms.
    inner = (ua * ea).sum(1)[:, None] + (ub * eb).sum(1)[None, :] - ua @ eb.T - ea @ ub.T
    return _dcfl_from_terms(end_dist, inner, ua.norm(dim=1), ub.norm(dim=1), variant)


def _dcfl_from_terms(
    end_dist: torch.Tensor,
    inner: torch.Tensor,
    norm_a: torch.Tensor,
    norm_b: torch.Tensor,
    variant: DcflVariant,
) -> torch.Tensor:
    """Eqs. 1-2 from |B_i - D_j|, <u_i - u'_j, B_i - D_j> and the update norms."""
    denom = end_dist * (norm_a[:, None] + norm_b[None, :])
    safe = denom > 0
    omega = torch.where(safe, inner / torch.where(safe, denom, 1.0), 0.0).clamp(-1.0, 1.0)
    scale = torch.exp(2.0 * omega)
    return scale if variant == "divergence" else end_dist * scale


def dcfl_distance_matrix(
    origins: ArrayLike, ends: ArrayLike, *, variant: DcflVariant = "complete"
) -> torch.Tensor:
    """DCFL's distance between all pairs of client update vectors [n, n] (DCFL eqs. 1-2).

    Client ``i``'s update runs from ``origins[i]`` (model received, A) to
    ``ends[i]`` (model after local training, B); ``u = B - A``. For two updates
    AB and CD, eq. 1's divergence
    ``omega = (|AB| cos(alpha) + |CD| cos(beta)) / (|AB| + |CD|)``, with
    ``alpha`` the angle between AB and D->B and ``beta`` the angle between CD and
    B->D, equals ``<u - u', B - D> / (|B - D| (|u| + |u'|))`` (``|AB| cos(alpha)``
    is the projection of AB on the unit vector D->B). Eq. 2:
    ``d = |BD| exp(2 omega)``; ``d = 0`` when the end points coincide (there,
    and when both updates are zero, ``omega`` is taken as 0).

    ``variant`` selects the distance of DCFL's Table II ablation:

    * ``"complete"``: eq. 2, ``|BD| exp(2 omega)``.
    * ``"divergence"``: the divergence alone, ``exp(2 omega)`` -- eq. 2 without
      the end-point distance ``|BD|`` (the text: it "does not depend at all from
      the actual distance of the update vectors, only their direction"); the
      exponential keeps it positive and monotone in ``omega``.
    * ``"cosine"``: cosine distance ``1 - cos(u, u')`` of the update vectors.
    * ``"euclidean"``: ``|BD|``, the euclidean distance between the models
      after training (the text: distances between clusters grow as training
      goes on, i.e. distances between models, not between updates).

    Float64 [n, n], symmetric, zero diagonal. Where ``n·d`` exceeds
    :data:`DCFL_DENSE_LIMIT` (e.g. 1,000 participants of a 784-200-10 MLP) the
    same Gram expansion runs over blocks of columns (:func:`_dcfl_square_blocked`),
    so memory stays at the float32 inputs plus [n, n] float64 matrices.
    """
    if variant in DCFL_VARIANTS and variant != "cosine":
        o, e = torch.as_tensor(origins), torch.as_tensor(ends)
        if o.ndim == 2 and o.shape == e.shape and o.shape[0] * o.shape[1] > DCFL_DENSE_LIMIT:
            return _distance_matrix(_dcfl_square_blocked(o, e, variant))
    return _distance_matrix(_dcfl_to(origins, ends, origins, ends, variant))


DCFL_DENSE_LIMIT = 1 << 24
"""Above this many input values (n·d) DCFL's distance matrix is computed over column
blocks: the dense form holds about eight float64 copies of [n, d] (1 GiB at the limit)."""

_BLOCK_COLUMNS = 4096


def _dcfl_square_blocked(
    origins: torch.Tensor, ends: torch.Tensor, variant: DcflVariant
) -> torch.Tensor:
    """:func:`_dcfl_to` of a set with itself from Gram matrices accumulated over blocks
    of ``_BLOCK_COLUMNS`` columns (each block in float64; the centring shift is the
    column mean, so it is exact per block). Equal to the dense form up to the
    order of float64 summation."""
    n, d = ends.shape
    gram_ee = torch.zeros(n, n, dtype=torch.float64, device=ends.device)
    gram_ue = torch.zeros_like(gram_ee)
    uu = torch.zeros(n, dtype=torch.float64, device=ends.device)
    for s in range(0, d, _BLOCK_COLUMNS):
        e = ends[:, s : s + _BLOCK_COLUMNS].to(torch.float64)
        u = e - origins[:, s : s + _BLOCK_COLUMNS].to(torch.float64)
        e = e - e.mean(dim=0)
        gram_ee.addmm_(e, e.T)
        gram_ue.addmm_(u, e.T)
        uu += (u * u).sum(1)
    sq = gram_ee.diagonal()
    end_dist = (sq[:, None] + sq[None, :] - 2.0 * gram_ee).clamp_min(0.0).sqrt()
    if variant == "euclidean":
        return end_dist
    ue = gram_ue.diagonal()
    inner = ue[:, None] + ue[None, :] - gram_ue - gram_ue.T
    norm = uu.sqrt()
    return _dcfl_from_terms(end_dist, inner, norm, norm, variant)


def dcfl_distance_to(
    origins_a: ArrayLike,
    ends_a: ArrayLike,
    origins_b: ArrayLike,
    ends_b: ArrayLike,
    *,
    variant: DcflVariant = "complete",
) -> torch.Tensor:
    """DCFL distances [n, m] from updates ``a`` (e.g. newcomers) to updates ``b`` (DCFL eq. 6).

    For newcomer assignment, ``a`` is the newcomer's update from the average
    model W_G and ``b`` holds the vectors W_G -> W_Ck of the clusters; the
    newcomer joins ``argmin`` over its row. Same formula and variants as
    :func:`dcfl_distance_matrix`. Float64.
    """
    return _dcfl_to(origins_a, ends_a, origins_b, ends_b, variant)


def dcfl_distance_to_directions(
    updates: ArrayLike,
    directions: ArrayLike,
    noise_sq: ArrayLike | None = None,
    *,
    variant: DcflVariant = "complete",
) -> torch.Tensor:
    """DCFL distances [n, K] from updates u_i to directions v_k that share their origin
    (DCFL eq. 6: the newcomer's update from W_G and the vectors W_G -> W_Ck), with the
    expected contribution of noise in the directions subtracted.

    From a common origin the end points differ by u - v, so eq. 1's divergence is
    ``omega = |u - v| / (|u| + |v|)`` and eq. 2 is ``|u - v| exp(2 omega)``. When
    ``v_k = delta_k + n_k`` carries noise of total expected squared norm
    ``noise_sq[k] = E|n_k|^2`` (independent of u, zero mean), ``E|u - v_k|^2 =
    |u - delta_k|^2 + noise_sq[k]`` and ``E|v_k|^2 = |delta_k|^2 + noise_sq[k]``: both
    squared norms are estimated without the noise (clamped at 0) and eqs. 1-2 are
    taken of the estimates; |u| has no noise. ``variant`` as in
    :func:`dcfl_distance_matrix` (cosine: ``1 -`` :func:`cosine_to_directions`).
    Without noise (``noise_sq`` None or 0) this equals :func:`dcfl_distance_to` with
    both origins at the common one. Float64.
    """
    if variant not in DCFL_VARIANTS:
        raise ConfigError(f"variant: expected one of {DCFL_VARIANTS}, got {variant!r}")
    if variant == "cosine":
        return 1.0 - cosine_to_directions(updates, directions, noise_sq)
    u, v, extra = _with_noise(updates, directions, noise_sq)
    u_sq, v_sq = (u * u).sum(1), (v * v).sum(1)
    end_sq = u_sq[:, None] + v_sq[None, :] - 2.0 * (u @ v.T) - extra[None, :]
    end = end_sq.clamp_min(0.0).sqrt()
    if variant == "euclidean":
        return end
    direction_norm = (v_sq - extra).clamp_min(0.0).sqrt()
    return _dcfl_from_terms(end, end * end, u_sq.sqrt(), direction_norm, variant)


def cosine_to_directions(
    updates: ArrayLike, directions: ArrayLike, noise_sq: ArrayLike | None = None
) -> torch.Tensor:
    """Cosines ``cos(u_i, delta_k)`` [n, K] estimated from noisy directions
    ``v_k = delta_k + n_k`` (FedGroup eq. 9 against released directions).

    ``<u, v_k>`` is unbiased for ``<u, delta_k>``; the squared norm ``|v_k|^2`` carries the
    noise's ``noise_sq[k] = E|n_k|^2 = d s_k^2`` (s_k per coordinate), which is subtracted.
    The estimate is not taken below the standard deviation of the noise's squared norm,
    ``s_k^2 sqrt(2d)``, where it carries no information. Without noise this is
    :func:`cosine_to`. Float64, clamped to [-1, 1].
    """
    u, v, extra = _with_noise(updates, directions, noise_sq)
    width = v.shape[1]
    floor = extra * (2.0 / width) ** 0.5  # (s^2 d) sqrt(2/d) = s^2 sqrt(2d)
    v_norm = ((v * v).sum(1) - extra).clamp_min(floor).sqrt()
    denom = u.norm(dim=1)[:, None] * v_norm[None, :]
    safe = denom > 0
    cos = torch.where(safe, (u @ v.T) / torch.where(safe, denom, 1.0), 0.0)
    return cos.clamp(-1.0, 1.0)


def _with_noise(
    updates: ArrayLike, directions: ArrayLike, noise_sq: ArrayLike | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of ``updates`` and ``directions`` and the directions' expected squared
    noise norms [K] (zeros for None), all float64."""
    u, v = as_rows(updates, "updates"), as_rows(directions, "directions")
    _check_same_width(u, v, "updates, directions")
    if noise_sq is None:
        return u, v, torch.zeros(len(v), dtype=torch.float64, device=v.device)
    extra = torch.as_tensor(noise_sq, dtype=torch.float64, device=v.device).reshape(-1)
    if len(extra) != len(v):
        raise ConfigError(
            f"noise_sq: expected {len(v)} values, one per direction, got {len(extra)}"
        )
    return u, v, extra


def svd_directions(updates: ArrayLike, n_directions: int) -> torch.Tensor:
    """The top-``m`` SVD directions V [m, d] of the updates, in parameter space (FedGroup eq. 8).

    ``V = SVD(dW^T, m)``: the top-``m`` right singular vectors of ``dW`` [n, d]
    (left singular vectors of ``dW^T``), unit rows, uncentred (as truncated
    SVD). Each direction's sign is arbitrary; EDC does not depend on it.
    """
    rows = as_rows(updates, "updates")
    if not 1 <= n_directions <= min(rows.shape):
        raise ConfigError(
            f"n_directions: expected 1..{min(rows.shape)} for updates of shape "
            f"{tuple(rows.shape)}, got {n_directions}"
        )
    return torch.linalg.svd(rows, full_matrices=False).Vh[:n_directions]


def edc_matrix(updates: ArrayLike, n_directions: int) -> torch.Tensor:
    """FedGroup's EDC [n, n]: euclidean distance of decomposed cosine similarity (eq. 8).

    ``EDC(i, j) = |K(dw_i, V^T) - K(dw_j, V^T)| / m`` with V the ``m`` SVD
    directions of :func:`svd_directions` and ``K`` the cosine kernel. FedGroup
    runs K-Means++ on the embedding ``cosine_to(updates, V)`` [n, m] itself
    (Alg. 3, line 14), whose euclidean distances are ``m * EDC``.
    Float64, symmetric, zero diagonal.
    """
    embedding = cosine_to(updates, svd_directions(updates, n_directions))
    return euclidean_distance_matrix(embedding) / n_directions


def madc_matrix(updates: ArrayLike) -> torch.Tensor:
    """FedGroup's MADC [n, n]: mean absolute difference of cosine similarities (eq. 7).

    ``MADC(i, j) = 1/(n - 2) * sum_{z != i, j} |S(i, z) - S(j, z)|``, S the
    cosine similarity matrix. Computed as the L1 distance between rows of S
    (``torch.cdist``, p=1) minus the two excluded terms ``z = i`` and ``z = j``.
    Needs ``n >= 3``. Float64, symmetric, zero diagonal.
    """
    sim = cosine_similarity_matrix(updates)
    n = sim.shape[0]
    if n < 3:
        raise ConfigError(f"updates: MADC needs at least 3 clients, got {n}")
    excluded = (sim.diagonal()[:, None] - sim).abs()  # [i, j] = |S(i, i) - S(i, j)|
    total = torch.cdist(sim, sim, p=1.0) - excluded - excluded.T
    return _distance_matrix(total.clamp_min(0.0) / (n - 2))


def trajectory_distance_matrix(trajectories: ArrayLike) -> torch.Tensor:
    """CFLGT's distance [n, n] between gradient trajectories (Sec. IV, Alg. 1 line 11).

    ``trajectories`` [n, C, 2] holds each client's C points (Z1'_c, Z2'_c); the
    distance of two clients is the mean over the C classes of the L2 distance
    between corresponding points. Any point dimension is accepted. Float64,
    symmetric, zero diagonal.
    """
    return _distance_matrix(trajectory_distance_to(trajectories, trajectories))


def trajectory_distance_to(a: ArrayLike, b: ArrayLike) -> torch.Tensor:
    """CFLGT trajectory distances [n, m] from trajectories ``a`` [n, C, 2] to ``b`` [m, C, 2].

    The mean over the C classes of the L2 distance between corresponding
    points, as :func:`trajectory_distance_matrix` (which is this with ``a = b``,
    symmetrised); used to place newcomers. Float64.
    """
    per_class = []
    for name, value in (("a", a), ("b", b)):
        t = torch.as_tensor(value)
        if t.ndim != 3 or t.shape[0] == 0 or t.shape[1] == 0:
            raise ConfigError(
                f"trajectories {name}: expected a non-empty 3-D tensor [n, C, 2], "
                f"got {tuple(t.shape)}"
            )
        per_class.append(t.to(torch.float64).transpose(0, 1))  # [C, n, 2]
    if per_class[0].shape[0] != per_class[1].shape[0]:
        raise ConfigError("trajectories: a and b have different numbers of classes")
    dist = torch.cdist(per_class[0], per_class[1], compute_mode="donot_use_mm_for_euclid_dist")
    return dist.mean(dim=0)
