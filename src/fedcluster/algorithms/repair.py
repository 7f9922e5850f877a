"""Cluster repair for methods whose clients choose among K models (beyond the papers; opt-in).

IFCA (Ghosh et al., NeurIPS 2020) and JGL (joint gradient and loss based clustered FL)
let every client pick the cluster model with the lowest loss (JGL: plus a
gradient-similarity term); FeSEM (Xie et al. 2020) puts each client's model
into the cluster of the nearest centre. When two true groups pick the same model in the
first rounds they train it together, it becomes the best model for both, and
nothing in either paper ever separates them again: the main job's 0° and 180°
groups share one model (purity 0.75) while another model starves. Sattler et
al.'s CFL (TNNLS 2021, Sec. III) gives the test that spots such a cluster: its
members' updates point in incongruent directions, so the cosine similarities
of the updates fall into two blocks.

The rule, applied by the server after the round's per-cluster averaging
(``repair:`` in the params of ``ifca`` / ``jgl`` / ``fesem``; absent = off, the
papers' behaviour and every number unchanged):

1. **Starved clusters.** A cluster is starved when at most
   ``starved_share`` × m / K of the round's m accepted clients chose it (0
   choosers: empty; JGL's Sec. II-C fix puts one random client into an empty
   cluster, which leaves it starved). Nothing happens without one.
2. **Incongruent cluster.** For every cluster k with at least
   2 × ``min_size`` choosers, largest first, the server takes the updates
   u_i = w_i − w_k of its choosers (it already holds the uploaded models w_i
   and w_k), splits them in two by complete linkage on their cosine
   similarities (CFL's bi-partition,
   :func:`~fedcluster.clustering.methods.bipartition`) and measures the
   *separation* = mean cosine similarity within the halves − mean cosine
   similarity across them. It splits when the separation is at least
   ``separation`` and both halves hold at least ``min_size`` clients.
3. **Re-seed.** The larger half keeps cluster k (its model is the average of
   that half's models), the smaller half's average becomes the model of the
   most starved cluster, and the smaller half's clients are assigned to it;
   both clusters' last updates Δw (JGL eq. 2) become the halves' mean updates
   from w_k. At most one split per starved cluster per round; not before
   round ``after`` + 1 (the first rounds' updates from random models are
   large and alike).

Cost: nothing extra on the wire. Every choosing client already uploads its
trained model (and IFCA/JGL broadcast all K models every round), so the
server computes the updates from what it holds, and the re-seeded model
reaches clients in the next round's broadcast. Server compute per examined
cluster of c choosers: a c × c Gram matrix of d-float updates (O(c² d)) and a
complete-linkage split of c points.

``diagnostics`` (per round): ``repair/c<k>/separation`` of every examined
cluster (NaN for the others) and ``repair/splits``, the splits made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from pydantic import Field

from fedcluster.algorithms.base import AlgorithmParams
from fedcluster.clustering.distances import cosine_similarity_matrix
from fedcluster.clustering.methods import bipartition
from fedcluster.engine.flat import weighted_average


class ClusterRepair(AlgorithmParams):
    """Parameters of cluster repair (module docstring)."""

    separation: float = Field(
        0.3,
        gt=0.0,
        le=2.0,
        description="split when mean within-half minus mean cross-half cosine similarity "
        "of the members' updates reaches this",
    )
    min_size: int = Field(2, ge=1, description="clients each half must hold")
    starved_share: float = Field(
        0.25,
        gt=0.0,
        le=1.0,
        description="a cluster chosen by at most this share of m/K clients may be re-seeded",
    )
    after: int = Field(1, ge=0, description="no repair in rounds 1..after")


@dataclass
class RepairResult:
    """What one round's repair did: new models, deltas and choices; separations for logging."""

    models: torch.Tensor
    delta: torch.Tensor
    choice: np.ndarray
    separation: np.ndarray  # [K], NaN where not examined
    splits: list[tuple[int, int]]  # (split cluster, re-seeded cluster)


def separation(similarity: torch.Tensor, first: np.ndarray) -> float:
    """Mean within-half minus mean cross-half similarity; ``first`` masks one half.

    Within-half pairs exclude the diagonal; a half of one client has no pair
    and contributes nothing to the within mean.
    """
    sim = similarity.double().numpy()
    first = np.asarray(first, dtype=bool)
    same = first[:, None] == first[None, :]
    np.fill_diagonal(same, False)
    cross = first[:, None] != first[None, :]
    if not same.any() or not cross.any():
        return float("nan")
    return float(sim[same].mean() - sim[cross].mean())


def repair_clusters(
    params: ClusterRepair,
    old: torch.Tensor,
    new: torch.Tensor,
    delta: torch.Tensor,
    rows: torch.Tensor,
    choice: np.ndarray,
    weights: np.ndarray | None,
    starts: torch.Tensor | None = None,
    compared: Callable[[torch.Tensor], torch.Tensor] = lambda rows: rows,
) -> RepairResult:
    """Apply the repair rule (module docstring) to one round.

    ``old`` [K, d]: the cluster models of the round's start; ``new``/``delta``:
    after the round's averaging; ``rows`` [m, d] and ``choice`` [m]: the
    accepted clients' models and clusters; ``weights`` [m] of the averaging
    (None: uniform); ``starts`` [m, d]: the model each client trained from
    (default ``old[choice]``; FeSEM's E-step may put a client into another
    cluster than the one it trained from). ``compared`` picks the part of an
    update the cosine similarities compare (:meth:`Context.compared`). Inputs are
    not modified.
    """
    k_models = len(old)
    m = len(choice)
    counts = np.bincount(choice, minlength=k_models)
    starved = [int(k) for k in np.argsort(counts, kind="stable")]
    starved = [k for k in starved if counts[k] <= params.starved_share * m / k_models]
    out = RepairResult(new.clone(), delta.clone(), choice.copy(), np.full(k_models, np.nan), [])
    w = torch.ones(m) if weights is None else torch.as_tensor(weights)
    for k in np.argsort(-counts, kind="stable"):
        k = int(k)
        idx = np.flatnonzero(choice == k)
        if not starved or k in starved or len(idx) < 2 * params.min_size:
            continue
        updates = compared(rows[idx] - (old[k] if starts is None else starts[idx]))
        sim = cosine_similarity_matrix(updates)
        first, _ = bipartition(sim, np.arange(len(idx)))
        in_first = np.isin(np.arange(len(idx)), first)
        gap = separation(sim, in_first)
        out.separation[k] = gap
        small = in_first if in_first.sum() <= (~in_first).sum() else ~in_first
        if not gap >= params.separation or small.sum() < params.min_size:
            continue
        target = starved.pop(0)
        keep, move = idx[~small], idx[small]
        for cluster, part in ((k, keep), (target, move)):
            mask = torch.as_tensor(part)
            out.models[cluster] = weighted_average(rows[mask], w[mask])
            out.delta[cluster] = out.models[cluster] - old[k]
        out.choice[move] = target
        out.splits.append((k, target))
    return out


def apply_repair(
    params: ClusterRepair | None,
    rnd: int,
    old: torch.Tensor,
    new: torch.Tensor,
    delta: torch.Tensor,
    rows: torch.Tensor,
    choice: np.ndarray,
    weights: np.ndarray | None,
    starts: torch.Tensor | None = None,
    compared: Callable[[torch.Tensor], torch.Tensor] = lambda rows: rows,
) -> RepairResult | None:
    """The round's repair for an algorithm's ``repair`` parameter: ``None`` when off; in
    rounds 1..``after`` nothing changes (every separation NaN); else :func:`repair_clusters`."""
    if params is None:
        return None
    if rnd <= params.after:
        return RepairResult(new, delta, choice, np.full(len(old), np.nan), [])
    return repair_clusters(params, old, new, delta, rows, choice, weights, starts, compared)


def repair_diagnostics(separation: np.ndarray | None, splits: int) -> dict[str, float]:
    """``repair/c<k>/separation`` per cluster and ``repair/splits`` (empty when repair is off)."""
    if separation is None:
        return {}
    out = {f"repair/c{k}/separation": float(v) for k, v in enumerate(separation)}
    out["repair/splits"] = float(splits)
    return out
