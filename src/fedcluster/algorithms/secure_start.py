"""The private start under secure aggregation: its sums gathered from the devices.

The private start (:mod:`fedcluster.privacy.private_start`) releases, with noise, four
kinds of sums over the clients' first updates u_i (sketched s_i = clip(P·clip(u_i, C),
C), coordinates e_i = Vᵀ s_i): the second moment Σ s_i s_iᵀ, the histogram of the
leading coordinates, each cluster's (Σ e_i, C·n_k) of a DP-Lloyd iteration, and each
final group's Σ clip(u_i, C) with its size. A trusted server computes them from the
uploads (:class:`~fedcluster.privacy.private_start.UpdateStatistics`); with
``privacy.secure_aggregation`` each device computes its own term of the step's sum from
its own update (the same class over its one row) and the server receives only the sum
(:meth:`~fedcluster.protocol.channel.Channel.ask_summed`; on Flower through SecAgg+).
The public values a step needs travel with it: the job's projection seed, the released
basis V and centres. A device trains its first update again at every step (the same
batches from the job's seed, so the same update), rather than keeping it between
messages. The server learns the sums and nothing of one device: not even its group.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from fedcluster.algorithms.base import Context
from fedcluster.engine.client_computations import TRAIN
from fedcluster.privacy.central import projection
from fedcluster.privacy.private_start import UpdateStatistics
from fedcluster.protocol.client_side import ClientBatch
from fedcluster.protocol.computation import Payload, Request
from fedcluster.protocol.secure_sum import summed_computation


def _contribution(stats: UpdateStatistics, request: Request) -> torch.Tensor:
    """One device's term of the sum the request's step asks for (module docstring)."""
    s, shared = request.settings, request.shared
    step = s["start_step"]
    if step == "moment":
        return stats.second_moment().flatten()
    if step == "cells":
        return stats.cell_counts(shared["basis"], int(s["cell_dims"]), int(s["grid"])).double()
    if step == "clusters":
        return stats.cluster_sums(shared["basis"], shared["centres"]).flatten().double()
    sums, sizes = stats.group_sums(shared["basis"], shared["centres"])
    return torch.cat([sums.flatten().double(), torch.as_tensor(sizes, dtype=torch.float64)])


def _share_shape(request: Request) -> tuple[int, ...]:
    s, shared = request.settings, request.shared
    step = s["start_step"]
    if step == "moment":
        return (int(s["sketch_dim"]) ** 2,)
    if step == "cells":
        return (int(s["grid"]) ** int(s["cell_dims"]),)
    k, r = shared["centres"].shape
    if step == "clusters":
        return (int(k) * (int(r) + 1),)
    return (int(k) * (shared["start"].shape[0] + 1),)


def _start_share(batch: ClientBatch, request: Request) -> Payload:
    s = request.settings
    updates = TRAIN.compute(batch, request)["row"] - request.shared["start"]
    matrix = projection(int(s["projection_seed"]), updates.shape[1], int(s["sketch_dim"]))
    terms = [
        _contribution(UpdateStatistics(updates[i : i + 1], matrix, float(s["clip"])), request)
        for i in range(len(updates))
    ]
    return {"share": torch.stack(terms)}


START_SHARE = summed_computation(
    "private-start-share", _share_shape, _start_share, "the device's term of a private-start sum"
)
"""A device's term of one step of the private start (the setting ``start_step``:
``moment``, ``cells``, ``clusters`` or ``groups``), from its first update."""


@dataclass
class DeviceStatistics:
    """:class:`~fedcluster.privacy.private_start.StartStatistics` gathered from the
    ``clients`` by secure sums: every step asks them to train from ``request``'s start
    and contribute (:data:`START_SHARE`). ``counted``: the clients in the first sum."""

    ctx: Context
    clients: np.ndarray
    request: Request
    sketch_dim: int
    clip: float
    counted: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def _sum(self, step: str, shared: Payload, **settings: int) -> torch.Tensor:
        request = replace(
            self.request,
            shared={**self.request.shared, **shared},
            settings={
                **self.request.settings,
                "start_step": step,
                "sketch_dim": self.sketch_dim,
                "projection_seed": self.ctx.seed,
                "clip": self.clip,
                # |entry| ≤ C² (a second moment), ≤ C (coordinates, updates) or 1 (counts)
                "entry_bound": max(self.clip, self.clip**2, 1.0),
                **settings,
            },
        )
        counted, total = self.ctx.channel.ask_summed(START_SHARE, self.clients, request, 0)
        if step == "moment":
            self.counted = counted
        return total

    def second_moment(self) -> torch.Tensor:
        return self._sum("moment", {}).reshape(self.sketch_dim, self.sketch_dim)

    def cell_counts(self, basis: torch.Tensor, m: int, cells: int) -> torch.Tensor:
        return self._sum("cells", {"basis": basis}, cell_dims=m, grid=cells).float()

    def cluster_sums(self, basis: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
        total = self._sum("clusters", {"basis": basis, "centres": centres})
        return total.reshape(len(centres), -1).float()

    def group_sums(
        self, basis: torch.Tensor, centres: torch.Tensor
    ) -> tuple[torch.Tensor, np.ndarray]:
        total = self._sum("groups", {"basis": basis, "centres": centres})
        k, d = len(centres), self.request.shared["start"].shape[0]
        sizes = np.rint(total[k * d :].numpy()).astype(np.int64)
        return total[: k * d].reshape(k, d).float(), sizes
