"""Secure aggregation per cluster: what a device adds to the K cluster sums, and what the
sum tells the server.

Under central DP (:mod:`fedcluster.privacy.central`) a trusted server sees every clipped
update and adds the noise to each cluster's sum. With ``privacy.secure_aggregation`` the
server sees only sums (Bonawitz et al., "Practical secure aggregation for
privacy-preserving machine learning", CCS 2017; Bell et al., "Secure single-server
aggregation with (poly)logarithmic complexity", CCS 2020 -- SecAgg+, which Flower
implements and :mod:`fedcluster.flower.secure` runs): every device that chose cluster c
among the K released models W_1..W_K and trained w from W_c contributes one vector of
length K·d + K + 2,

    s = [ e_c ⊗ clip(w − W_c, C_t) | e_c | 1[‖w − W_c‖ ≤ C_t] | min(loss, L) ],

its clipped update in its cluster's slot (zeros in the K − 1 others), a one-hot count,
its unclipped bit of adaptive clipping (Andrew et al., NeurIPS 2021, Alg. 1) and its
training loss capped at L = :data:`LOSS_CAP`. The server learns only Σ s: each cluster's
clipped sum S_k and size n_k, the number of unclipped updates and the summed loss --
not which device chose which cluster, nor any update. It then adds the Gaussian noise to
each S_k as the trusted server does (:meth:`CentralDP.release_sum`), so the released
models, the adaptive clip norm and the ε column are the trusted server's (the clipping
moves to the device; the sums differ only by float rounding, and on Flower by SecAgg+'s
quantization). Every contribution is bounded by construction (‖update‖ ≤ C_t, 0/1
counts, a capped loss), which is all the server can check of what it cannot see.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from fedcluster.privacy.mechanisms import clip_rows
from fedcluster.protocol.client_side import ClientBatch
from fedcluster.protocol.computation import (
    ClientComputation,
    Payload,
    ReplyField,
    Request,
    lookup_computation,
    register_computation,
)

LOSS_CAP = 16.0
"""The largest training loss a device adds to the summed loss (a chance-level
cross-entropy over 10 classes is 2.3): the sum's entries stay bounded."""


def entry_bound(clip: float) -> float:
    """The largest absolute entry of one contribution: a clipped update's coordinate
    (≤ C_t), a 0/1 count or bit, the capped loss."""
    return max(float(clip), LOSS_CAP, 1.0)


def share_length(k: int, d: int) -> int:
    """Length of one device's contribution for K models of width d: K·d + K + 2."""
    return k * d + k + 2


def shares(
    rows: torch.Tensor,
    models: torch.Tensor,
    clusters: torch.Tensor,
    loss: torch.Tensor,
    clip: float,
) -> torch.Tensor:
    """The contributions [n, K·d + K + 2] of n devices that trained ``rows`` [n, d] from
    the ``models`` [K, d] they chose (``clusters`` [n]) with training ``loss`` [n], under
    the clip norm ``clip`` (module docstring)."""
    k, d = models.shape
    chosen = clusters.long()
    updates = clip_rows(rows.double() - models.double()[chosen], clip)
    out = torch.zeros(len(rows), share_length(k, d), dtype=torch.float64)
    positions = torch.arange(len(rows))
    slots = out[:, : k * d].view(len(rows), k, d)
    slots[positions, chosen] = updates
    out[positions, k * d + chosen] = 1.0
    out[:, k * d + k] = ((rows.double() - models.double()[chosen]).norm(dim=1) <= clip).double()
    out[:, -1] = torch.nan_to_num(loss.double(), nan=LOSS_CAP).clamp(0.0, LOSS_CAP)
    return out


@dataclass(frozen=True)
class SecureTotal:
    """What the server learns from the sum of a round's contributions."""

    sums: torch.Tensor
    """S_k [K, d]: each cluster's sum of clipped updates (float64)."""
    counts: np.ndarray
    """n_k [K]: how many devices chose each cluster."""
    unclipped: float
    """How many updates were within the clip norm (adaptive clipping's bit sum)."""
    loss_sum: float
    """The summed (capped) training loss."""

    @classmethod
    def from_vector(cls, total: torch.Tensor, k: int, d: int) -> SecureTotal:
        """Unpack Σ s; the counts are rounded (quantization leaves them near integers)."""
        total = total.double()
        counts = np.rint(total[k * d : k * d + k].numpy()).astype(np.int64)
        return cls(
            total[: k * d].reshape(k, d).clone(),
            counts,
            float(total[k * d + k]),
            float(total[-1]),
        )

    def released(self, models: torch.Tensor, release: Callable[..., torch.Tensor]) -> torch.Tensor:
        """The K models [K, d] after this sum: each cluster with members released by
        ``release(start, sum, n)`` (:meth:`CentralDP.release_sum`) in ascending order, as
        the trusted server's per-cluster aggregation draws its noise; the others kept."""
        new = models.clone()
        for k in np.flatnonzero(self.counts):
            new[k] = release(models[k], self.sums[k], int(self.counts[k]))
        return new

    @property
    def n(self) -> int:
        """How many devices contributed."""
        return int(self.counts.sum())

    @property
    def mean_loss(self) -> float:
        """The contributors' mean (capped) training loss; NaN without contributors."""
        return self.loss_sum / self.n if self.n else float("nan")


def start_models(request: Request) -> torch.Tensor:
    """The K models [K, d] a secure request's devices start from (one start row: K = 1)."""
    rows = request.shared[str(request.settings["secure_start"])]
    return rows.unsqueeze(0) if rows.dim() == 1 else rows


def _share_shape(request: Request) -> tuple[int, ...]:
    k, d = start_models(request).shape
    return (share_length(int(k), int(d)),)


def _secure_share(batch: ClientBatch, request: Request) -> Payload:
    s = request.settings
    base = lookup_computation(str(s["secure_of"]), str(s.get("secure_of_module", "")) or None)
    reply = base.compute(batch, request)
    chosen = base.start_index
    clusters = reply[chosen] if chosen else torch.zeros(len(reply["row"]), dtype=torch.int64)
    models = start_models(request)
    return {"share": shares(reply["row"], models, clusters, reply["loss"], s["clip"])}


def summed_computation(
    name: str,
    shape: Callable[[Request], tuple[int, ...]],
    run: Callable[[ClientBatch, Request], Payload],
    what: str,
) -> ClientComputation:
    """A registered computation whose reply is one device's term ``share`` (float64, of
    ``shape``) of a secure sum; ``what`` the term is, for the local-DP exemption."""
    return register_computation(
        ClientComputation(
            name=name,
            reply={"share": ReplyField(shape, dtype=torch.float64)},
            batched_run=run,
            exempt_because=(
                f"{what}: a term of a secure sum under central DP; the server adds the "
                "noise to the sum, the only thing it sees"
            ),
        )
    )


SECURE_SHARE = summed_computation(
    "secure-share", _share_shape, _secure_share, "the device's clipped update and counts"
)
"""A training from the request's shared start row, or choosing among its models (the
computation named by the setting ``secure_of``), turned into the device's contribution
to the secure sum (:func:`shares`, clipped to the setting ``clip``)."""


def secure_request(base: ClientComputation, request: Request, clip: float) -> Request:
    """``request`` of the training ``base`` (from one shared start row, or choosing among
    shared models: ``start_index``) asked as its contribution."""
    if base.update is None or base.update[1] not in request.shared or "loss" not in base.reply:
        raise ValueError(f"{base.name}: secure aggregation needs a training from shared starts")
    settings = {
        **request.settings,
        "secure_of": base.name,
        "secure_of_module": base.module,
        "secure_start": base.update[1],
        "clip": float(clip),
        "entry_bound": entry_bound(clip),
    }
    return replace(request, settings=settings)
