"""Aggregation rules: the plain weighted average and six robust alternatives.

Every rule maps ``(start, rows, weights)`` to one aggregated row [d]: ``start``
is the model the clients trained from ([d], or [n, d] per client), ``rows``
[n, d] the models they uploaded, ``weights`` [n] their non-negative weights
(e.g. sample counts).

- ``mean``: the weighted average sum_i w_i x_i / sum_i w_i -- FedAvg's server
  step (McMahan et al., AISTATS 2017, Alg. 1) and the per-cluster averages of
  the clustered algorithms. The default: the papers' numbers.
- ``median``: the coordinate-wise median of the uploaded models (Yin, Chen,
  Ramchandran, Bartlett, "Byzantine-robust distributed learning: towards
  optimal statistical rates", ICML 2018, Option I). Like the paper it gives
  every client one vote (weights are ignored): a client cannot buy influence
  by claiming more samples. Breakdown point 1/2.
- ``trimmed_mean``: per coordinate, drop the ``floor(trim·n)`` smallest and
  largest values and average the rest (Yin et al. 2018, Option II, the
  β-trimmed mean), weighted by the remaining clients' weights (with equal
  weights exactly ``scipy.stats.trim_mean``). Tolerates a share ``trim`` of
  bad clients per side.
- ``clipped_mean``: every update u_i = x_i − start_i is clipped to the norm τ,
  u_i·min(1, τ/‖u_i‖), and the clipped updates are averaged with the weights.
  τ is a robust per-round scale: the ``clip_quantile`` quantile of the round's
  update norms, by default the median. A quantile q can be moved by a share q
  of clients sending small updates and by a share 1 − q sending large ones:
  the median holds against up to half on either side. The lower quartile
  (an earlier default) survives a majority of huge updates but not a
  quarter of colluders sending short ones (ALIE, Baruch et al. 2019: every
  honest update is then clipped to the attackers' norm; measured in
  docs/reliability.md, e.g. IFCA 62.3% with the quartile, 82.0% with the
  median, 82.9% with the plain mean). Norm clipping against model
  replacement / boosted updates follows Sun, Kairouz, Suresh, McMahan, "Can
  you really backdoor federated learning?", 2019 (norm bounding), and
  Karimireddy, He, Jaggi, "Learning from history for Byzantine robust
  optimization", ICML 2021 (centered clipping).
  The quantile is taken over *all* updates the server accepted in the round
  (``Aggregator.round_norms``, recorded by the channel), not over one
  cluster's: a cluster of one or two members has no robust scale of its own
  (measured: with 25% of the clients boosting ×10 and per-cluster scales,
  IFCA's boosted singleton clusters wrecked their models and every client
  fled to one cluster, purity 0.25).
- ``aligned_mean``: ``clipped_mean`` over the updates that point the way the
  cluster goes (:func:`aligned`): after clipping, *copies* are left out
  (updates whose cosine with another is ≥ :data:`COPY_COSINE`: colluders
  sending one vector, the similarity FoolsGold looks for -- Fung, Yoon,
  Beschastnikh, RAID 2020), then the updates whose cosine with the
  coordinate-wise median of the rest is ≤ 0 (a step that would leave none is
  skipped). Clipping bounds how far any update moves the model; the
  direction test removes sign-flipped updates, which clipping cannot see
  (their norm is honest). It is FLTrust's idea (Cao, Fang, Liu, Gong,
  NDSS 2021: a client's trust is ReLU of its update's cosine with a
  reference direction) with the robust coordinate median as the reference
  instead of an update computed on server-held data, and a 0/1 trust so
  that the honest clients keep their sample weights. Without the copy test
  the ALIE colluders of a cluster make its median and the honest members
  are the ones that point away.
- ``multi_krum``: the mean of the n − f updates with the lowest Krum scores
  (Blanchard, El Mhamdi, Guerraoui, Stainer, NeurIPS 2017), f =
  ⌊``byzantine``·n⌋.
- ``guarded_mean``: ``aligned_mean``'s survivors, thinned by Multi-Krum's
  selection within one budget of f = ⌊``byzantine``·n⌋ exclusions: updates
  that point the right way but lie far from the rest (label flipping) go too.

Every rule is stateless: nothing is carried from round to round, so a
resumed run needs nothing beyond the algorithm's checkpointed state.

:func:`aggregate` is the one entry point; with ``rule="mean"`` it calls
:func:`fedcluster.engine.flat.weighted_average` unchanged, so runs with the
default rule give the same bytes as before the robust rules existed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, get_args

import torch

from fedcluster.config.schema import AggregationRule
from fedcluster.engine.flat import weighted_average

Rule = AggregationRule
RULES: tuple[str, ...] = get_args(AggregationRule)


def _start_rows(start: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return start.expand_as(rows) if start.dim() == 1 else start


def weighted_mean(start: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The plain weighted average of ``rows`` (``start`` is not needed)."""
    return weighted_average(rows, weights)


def coordinate_median(
    start: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Coordinate-wise median of ``rows`` [n, d] (Yin et al. 2018); even n: mean of the middle two.

    Weights are ignored (one client, one vote); ``start`` is not needed (the
    median is translation-equivariant).
    """
    n = rows.shape[0]
    ordered = rows.sort(dim=0).values
    mid = n // 2
    if n % 2:
        return ordered[mid].clone()
    return (ordered[mid - 1] + ordered[mid]) / 2


def trimmed_mean(
    start: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, trim: float
) -> torch.Tensor:
    """Coordinate-wise β-trimmed mean of ``rows`` [n, d], β = ``trim`` (Yin et al. 2018).

    Per coordinate the ``floor(trim·n)`` smallest and largest values are
    dropped; the rest are averaged with the weights of the clients they came
    from. With fewer than three rows nothing can be dropped on both sides and
    the weighted mean is returned.
    """
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim}")
    n = rows.shape[0]
    k = int(trim * n)
    if k == 0:
        return weighted_average(rows, weights)
    ordered, index = rows.sort(dim=0)
    kept = ordered[k : n - k]
    w = weights.to(rows.dtype)[index[k : n - k]]  # each value keeps its client's weight
    return (kept * w).sum(dim=0) / w.sum(dim=0)


def clip_scale(norms: torch.Tensor, quantile: float = 0.5) -> float:
    """The clipping norm τ: the ``quantile`` quantile of the update ``norms`` (0.5: the median).

    Computed in float64 with the lower order statistic (no interpolation), so
    τ is the norm of an actual update.
    """
    return float(torch.quantile(norms.double(), quantile, interpolation="lower"))


def clipped_updates(
    start: torch.Tensor,
    rows: torch.Tensor,
    quantile: float = 0.5,
    reference_norms: Sequence[float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(base, clipped)``: the start rows [n, d] and the updates clipped to τ.

    u_i = rows_i − start_i is scaled by min(1, τ/‖u_i‖) with τ = :func:`clip_scale`
    of ``reference_norms`` (the round's accepted update norms) where given and
    non-empty, else of the rows' own update norms; updates with ‖u_i‖ ≤ τ pass
    unchanged.
    """
    base = _start_rows(start, rows)
    updates = rows - base
    norms = updates.double().norm(dim=1)
    scale_from = (
        norms if not reference_norms else torch.as_tensor(reference_norms, dtype=torch.float64)
    )
    tau = clip_scale(scale_from, quantile)
    factor = torch.where(norms > tau, tau / norms.clamp_min(1e-300), torch.ones_like(norms))
    return base, updates * factor.to(rows.dtype).unsqueeze(1)


def clipped_mean(
    start: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    quantile: float = 0.5,
    reference_norms: Sequence[float] | None = None,
) -> torch.Tensor:
    """Weighted mean of the updates clipped to the round's robust scale, added to the start
    (:func:`clipped_updates`)."""
    base, clipped = clipped_updates(start, rows, quantile, reference_norms)
    return weighted_average(base + clipped, weights)


COPY_COSINE = 0.9999
"""Two updates whose cosine reaches this are copies: honest clients with their own data
and mini-batches never send the same update, colluding ones do (ALIE: every attacker
sends one vector). Measured: the most alike two honest updates aggregated together in
15 fault-free rounds of the quickstart federation have cosine 0.814 (FedAvg and IFCA)."""


def copies(updates: torch.Tensor) -> torch.Tensor:
    """Mask [n] of the ``updates`` [n, d] that have a copy among the others (cosine ≥
    :data:`COPY_COSINE`): FoolsGold's signal (Fung, Yoon, Beschastnikh, "The limitations of
    federated learning in sybil settings", RAID 2020) that colluding clients share one
    objective and so send updates more alike than honest clients' ever are."""
    u = updates.double()
    unit = u / u.norm(dim=1, keepdim=True).clamp_min(1e-300)
    cosine = unit @ unit.T
    cosine.fill_diagonal_(-1.0)
    return (cosine >= COPY_COSINE).any(dim=1)


def aligned(clipped: torch.Tensor) -> torch.Tensor:
    """Mask [n] of the ``clipped`` updates [n, d] that :func:`aligned_mean` keeps.

    Copies (:func:`copies`) are left out first, so that colluders cannot make
    the reference; then the updates whose cosine with the coordinate-wise
    median of the others is ≤ 0. Where a step would leave nothing it is skipped.
    """
    kept = ~copies(clipped)
    if not kept.any():
        kept = torch.ones_like(kept)
    u = clipped.double()
    reference = coordinate_median(u[0], u[kept], torch.ones(int(kept.sum())))
    cosine = torch.nn.functional.cosine_similarity(u, reference.unsqueeze(0), dim=1)
    pointing = kept & (cosine > 0)
    return pointing if pointing.any() else kept


def aligned_mean(
    start: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    quantile: float = 0.5,
    reference_norms: Sequence[float] | None = None,
) -> torch.Tensor:
    """:func:`clipped_mean` of the clipped updates that :func:`aligned` keeps: no copies,
    and a positive cosine with the coordinate-wise median of the rest (every update kept
    if none is, e.g. a zero median)."""
    base, clipped = clipped_updates(start, rows, quantile, reference_norms)
    kept = aligned(clipped)
    return weighted_average(base[kept] + clipped[kept], weights[kept])


def krum_scores(updates: torch.Tensor, f: int) -> torch.Tensor:
    """Krum's score of each of ``updates`` [n, d] against ``f`` Byzantine ones (float64, [n]).

    s(i) = Σ_{i→j} ‖V_i − V_j‖², the sum over the n − f − 2 updates closest to
    V_i (Blanchard, El Mhamdi, Guerraoui, Stainer, "Machine learning with
    adversaries: Byzantine tolerant gradient descent", NeurIPS 2017, Sec. 4);
    at least one neighbour where n − f − 2 < 1 (the paper needs n > 2f + 2).
    """
    n = updates.shape[0]
    u = updates.double()
    squares = torch.cdist(u, u).square()
    neighbours = min(max(n - f - 2, 1), n - 1)
    closest = squares.sort(dim=1).values[:, 1 : neighbours + 1]  # column 0: itself
    return closest.sum(dim=1)


def krum_selection(updates: torch.Tensor, f: int) -> torch.Tensor:
    """Indices of the n − f ``updates`` [n, d] with the lowest :func:`krum_scores`
    (Multi-Krum's choice; ties keep the earlier update)."""
    scores = krum_scores(updates, f)
    return torch.sort(scores, stable=True).indices[: updates.shape[0] - f]


def multi_krum(
    start: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, byzantine: float = 0.25
) -> torch.Tensor:
    """Multi-Krum (Blanchard et al., NeurIPS 2017, Sec. 5): the weighted mean of the
    m = n − f rows whose updates have the lowest :func:`krum_scores`, f = ⌊``byzantine``·n⌋.

    With fewer than three rows (no neighbour to compare with besides the
    other) or f = 0, the weighted mean of all.
    """
    n = rows.shape[0]
    f = int(byzantine * n)
    if n < 3 or f == 0:
        return weighted_average(rows, weights)
    chosen = krum_selection(rows - _start_rows(start, rows), f)
    return weighted_average(rows[chosen], weights[chosen])


def guarded_mean(
    start: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    quantile: float = 0.5,
    reference_norms: Sequence[float] | None = None,
    byzantine: float = 0.25,
) -> torch.Tensor:
    """:func:`aligned_mean` followed by Multi-Krum's selection among what it keeps.

    The server budgets f = ⌊``byzantine``·n⌋ exclusions: the updates
    :func:`aligned` leaves out (copies, updates pointing away) count against
    it, and the rest of the budget goes to the worst :func:`krum_scores` of
    the survivors' updates as sent (Blanchard et al. 2017; unclipped, so that
    a long update stays far), which catches updates that point the right way
    but far from the others (label flipping). The survivors' clipped updates
    are averaged with their weights.
    """
    base, clipped = clipped_updates(start, rows, quantile, reference_norms)
    kept = torch.nonzero(aligned(clipped)).flatten()
    budget = int(byzantine * rows.shape[0]) - (rows.shape[0] - len(kept))
    if budget > 0 and len(kept) >= 3:
        kept = kept[krum_selection(rows[kept] - base[kept], budget)]
    return weighted_average(base[kept] + clipped[kept], weights[kept])


class Aggregate(Protocol):
    """What averages a cluster's client rows: an :class:`Aggregator` rule or central
    DP's noisy clipped mean (:class:`~fedcluster.privacy.central.CentralDP`)."""

    def __call__(
        self, start: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class Aggregator:
    """One aggregation rule with its parameters; called by every algorithm that averages models.

    ``aggregator(start, rows, weights)`` returns the aggregated row [d].
    ``weights`` ``None`` means equal weights.
    """

    rule: Rule = "mean"
    trim: float = 0.1
    clip_quantile: float = 0.5
    byzantine: float = 0.25
    round_norms: Callable[[], Sequence[float]] | None = field(default=None, compare=False)
    """The norms of every update accepted in the current round (the channel's
    record): the clipping rules take their scale τ from these."""

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"unknown aggregation rule {self.rule!r}; allowed: {RULES}")

    def __call__(
        self, start: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        return aggregate(start, rows, weights, self)


MEAN = Aggregator()


def aggregate(
    start: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor | None = None,
    how: Aggregator = MEAN,
) -> torch.Tensor:
    """``rows`` [n, d] trained from ``start`` aggregated into one row [d] by the rule ``how``."""
    w = torch.ones(rows.shape[0]) if weights is None else torch.as_tensor(weights)
    if how.rule == "mean":
        return weighted_average(rows, w)
    if how.rule == "median":
        return coordinate_median(start, rows, w)
    if how.rule == "trimmed_mean":
        return trimmed_mean(start, rows, w, how.trim)
    if how.rule == "multi_krum":
        return multi_krum(start, rows, w, how.byzantine)
    reference = None if how.round_norms is None else how.round_norms()
    if how.rule == "guarded_mean":
        return guarded_mean(start, rows, w, how.clip_quantile, reference, how.byzantine)
    clip = aligned_mean if how.rule == "aligned_mean" else clipped_mean
    return clip(start, rows, w, how.clip_quantile, reference)
