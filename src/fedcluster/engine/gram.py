"""Per-client Gram matrices of the training inputs, for the deferred first-layer update.

:meth:`MLPKernel.sgd_deferred <fedcluster.engine.mlp_kernel.MLPKernel.sgd_deferred>`
corrects a chunk's pre-activations with inner products X_s X_tᵀ of the
chunk's samples. A client's samples do not change between rounds (only their
order does), so the inner products of all pairs of its samples, X_c X_cᵀ, are
computed once and each round's chunk Gram matrix is a gather from it.

That pays when a client's data is not much larger than a chunk: X_c X_cᵀ costs
n² products of input rows, a round's chunk Grams about n·B·(T − 1)/2. The
cache is used for a whole federation or not at all (:meth:`GramCache.suits`),
so the same config gives the same arithmetic whatever the participation.
"""

from __future__ import annotations

import numpy as np
import torch

DEFAULT_BUDGET = 256 * 2**20
"""Bytes the cached Gram matrices of a federation may take (float32)."""

MAX_CHUNKS = 4
"""Clients with more than this many chunks of samples compute their Gram blocks per round."""


class GramCache:
    """X_c X_cᵀ (float32, [n_c, n_c]) of each client c, computed on first use.

    ``samples`` [N, f] are the packed training inputs, client c owning rows
    ``offsets[c]:offsets[c + 1]``. :meth:`invalidate` drops the matrices of
    clients whose data changed (drift).
    """

    def __init__(
        self,
        samples: torch.Tensor,
        offsets: np.ndarray,
        budget: int = DEFAULT_BUDGET,
        low: torch.dtype | None = None,
    ) -> None:
        self.samples = samples
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.budget = budget
        self.low = low
        """The product dtype of a ``precision: bf16`` run (:meth:`compute`), else ``None``."""
        self._grams: dict[int, torch.Tensor] = {}

    def suits(self, chunk_rows: int) -> bool:
        """Whether to use the cache with chunks of ``chunk_rows`` samples: every client
        holds at most :data:`MAX_CHUNKS` chunks and all matrices fit in the budget."""
        sizes = np.diff(self.offsets)
        if len(sizes) == 0 or sizes.max() > MAX_CHUNKS * chunk_rows:
            return False
        return int((sizes.astype(np.int64) ** 2).sum()) * 4 <= self.budget

    def invalidate(self, clients: np.ndarray) -> None:
        for c in np.asarray(clients).tolist():
            self._grams.pop(int(c), None)

    def client(self, c: int) -> torch.Tensor:
        """X_c X_cᵀ of client ``c``, accumulated in float64 and rounded once.

        The result then does not depend on how the product is split across
        threads (a client's matrix is computed in whichever round first
        trains it, so a resumed run may compute it under other threading);
        for 8-bit image data the float64 sums are exact.
        """
        gram = self._grams.get(c)
        if gram is None:
            gram = self._grams[c] = self.compute(c)
        return gram

    def compute(self, c: int) -> torch.Tensor:
        """X_c X_cᵀ of client ``c`` as :meth:`client` computes it, without keeping it.

        With ``low`` (bf16 runs) a product of ``low`` operands, as the kernel's other
        products over the inputs: X rounded to bfloat16 is then the X of every
        first-layer product and of the Gram correction, which the kernel takes in
        ``low`` anyway; about 10× faster than the float64 product (IFCA's 2,400
        clients: 1.3 s in the first round, 2 threads).
        """
        x = self.samples[int(self.offsets[c]) : int(self.offsets[c + 1])]
        x = x.double() if self.low is None else x.to(self.low)
        return torch.mm(x, x.t()).to(self.samples.dtype)

    def fill(self, clients: np.ndarray, x: torch.Tensor) -> None:
        """Cache X_c X_cᵀ of the ``clients`` [G] not cached yet from their gathered inputs
        ``x`` [G, R, f] (client c's own rows first, in stored order, padding after), in
        one batched product: bf16 runs only (``low``; float32 runs keep :meth:`compute`'s
        float64 products). Each member's block is :meth:`compute`'s product (the same
        operands and reductions; tested equal), without 2,400 small calls in a round.
        """
        if self.low is None:
            return
        missing = [g for g, c in enumerate(np.asarray(clients).tolist()) if c not in self._grams]
        if not missing:
            return
        xs = x[torch.as_tensor(missing, device=x.device)].to(self.low)
        products = torch.bmm(xs, xs.transpose(1, 2))
        for i, g in enumerate(missing):
            c = int(clients[g])
            n = int(self.offsets[c + 1] - self.offsets[c])
            self._grams[c] = products[i, :n, :n].to(self.samples.dtype).contiguous()

    def gather(self, clients: np.ndarray, chosen: torch.Tensor) -> torch.Tensor:
        """Gram matrices [G, R, R] of the samples ``chosen`` [G, R] (global row indices)
        of member g, a client of ``clients`` [G]. Indices outside the member's own
        rows (padding) read its first sample: they meet only zero gradients."""
        out = torch.empty(
            chosen.shape[0], chosen.shape[1], chosen.shape[1], device=self.samples.device
        )
        for g, c in enumerate(np.asarray(clients).tolist()):
            gram = self.client(c)
            local = (chosen[g] - int(self.offsets[c])).clamp_(0, len(gram) - 1)
            torch.index_select(gram.index_select(0, local), 1, local, out=out[g])
        return out
