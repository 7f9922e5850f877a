"""K models on many clients' data in one pass, each distinct data set once.

The K-model losses of IFCA's cluster identity estimate (Ghosh et al. 2020,
Alg. 1: ĵ = argmin_j F_i(θ_j) on all of client i's data, ``choice_batches:
all``) and of its test protocol (``model_choice: own_loss``, reference code
``get_inference_stats``), and every evaluation, are forward passes of K
models over the clients' samples. This module runs them over *chunks* (one
client's samples, or a set several clients share) so that

- every chunk's samples are read once for all K models: the caller's
  ``logits(x)`` gives [K, P, C] (for an MLP
  :meth:`~fedcluster.engine.mlp_kernel.MLPKernel.logits`, whose first layer is
  one product X [W₁ | … | W_K]ᵀ);
- a test set that several clients share is evaluated once and its result
  given to each of them (IFCA's rotated-MNIST preset: 2,400 clients test on
  400 distinct chunks). :func:`distinct_chunks` finds equal chunks by
  content (a digest, then an exact comparison).

The sums are those of a per-client evaluation to the last bit: each sample's
loss is computed by the same operators whatever the number of rows beside it,
and each chunk's float64 loss sum adds its samples in their stored order,
starting from zero, as a client's own sum does (tested).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from fedcluster.engine.precision import fast_log_softmax

EVAL_ROWS = 8192
"""Samples per forward pass of one model (K models: EVAL_ROWS // K each)."""


def distinct_chunks(x: torch.Tensor, y: torch.Tensor, offsets: np.ndarray) -> np.ndarray:
    """For every client c (rows ``offsets[c]:offsets[c + 1]`` of ``x``, ``y``), the
    first client whose samples and labels are exactly equal to c's (c itself if none).

    Candidates are found by a digest of the labels and of each sample's sum (equal
    samples have equal sums: the same reduction of the same values) and confirmed
    with an exact comparison. One reduction over all samples replaces hashing every
    byte (IFCA's 2,400 test chunks, 753 MB: 1.0 s hashed byte by byte).
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    prints = x.reshape(len(x), -1).sum(dim=1).cpu().numpy()
    labels = y.cpu().numpy()
    first: dict[bytes, list[int]] = {}
    out = np.arange(len(offsets) - 1)
    for c in range(len(out)):
        lo, hi = int(offsets[c]), int(offsets[c + 1])
        digest = hashlib.blake2b(digest_size=16)
        digest.update(np.asarray(x[lo:hi].shape).tobytes())
        digest.update(prints[lo:hi].tobytes())
        digest.update(labels[lo:hi].tobytes())
        candidates = first.setdefault(digest.digest(), [])
        for r in candidates:  # equal digests: confirm exactly
            rlo, rhi = int(offsets[r]), int(offsets[r + 1])
            if torch.equal(x[rlo:rhi], x[lo:hi]) and torch.equal(y[rlo:rhi], y[lo:hi]):
                out[c] = r
                break
        else:
            candidates.append(c)
    return out


def chunk_stats(
    logits: Callable[[torch.Tensor], torch.Tensor],
    n_models: int,
    x: torch.Tensor,
    y: torch.Tensor,
    offsets: np.ndarray,
    chunks: np.ndarray,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    fast_softmax: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Correct predictions (int64) and summed losses (float64), both
    [len(chunks), n_models], of every model on every chunk.

    Chunk i holds rows ``offsets[chunks[i]]:offsets[chunks[i] + 1]`` of ``x``, ``y``;
    ``logits(x_part)`` gives the models' logits [K, P, C]. The loss is
    cross-entropy (``loss=None``): each chunk's loss adds its samples' float64
    losses in order, as :func:`numpy.add.at` over the concatenated rows does;
    ``fast_softmax`` (bf16 runs) takes its log-softmax from
    :func:`~fedcluster.engine.precision.fast_log_softmax`.
    A user's mean loss (:mod:`fedcluster.engine.modes`) is taken over each
    chunk's samples within a pass and multiplied by their count.
    """
    chunks = np.asarray(chunks, dtype=np.int64)
    lo, hi = offsets[chunks], offsets[chunks + 1]
    sizes = (hi - lo).astype(np.int64)
    spans = [np.arange(a, b) for a, b in zip(lo, hi, strict=True)]
    rows = np.concatenate(spans) if spans else np.zeros(0, np.int64)
    owner = np.repeat(np.arange(len(chunks)), sizes)
    idx = torch.as_tensor(rows.astype(np.int64), device=x.device)
    correct = np.zeros((len(chunks), n_models), dtype=np.int64)
    loss_sum = np.zeros((len(chunks), n_models), dtype=np.float64)
    step = max(1, EVAL_ROWS // n_models)
    # consecutive rows (e.g. every client's training data, IFCA's choice): slices, no gather
    first = int(rows[0]) if len(rows) else 0
    consecutive = np.array_equal(rows, np.arange(first, first + len(rows)))
    for s in range(0, len(idx), step):
        part = idx[s : s + step]
        target = y[part]
        out = logits(x[first + s : first + s + len(part)] if consecutive else x[part])  # [K, P, C]
        hit = (out.argmax(dim=2) == target).cpu().numpy()
        own = owner[s : s + step]
        for j in range(n_models):
            correct[:, j] += np.bincount(own, weights=hit[j], minlength=len(chunks)).astype(
                np.int64
            )
        if loss is None:
            flat, targets = out.reshape(-1, out.shape[2]), target.repeat(n_models)
            if fast_softmax:
                nll = -fast_log_softmax(flat).gather(1, targets.unsqueeze(1)).squeeze(1)
            else:
                nll = F.cross_entropy(flat, targets, reduction="none")
            per_sample = nll.view(n_models, -1).double().cpu().numpy()
            for j in range(n_models):
                np.add.at(loss_sum[:, j], own, per_sample[j])
        else:
            for o in np.unique(own):
                sel = torch.as_tensor(np.flatnonzero(own == o), device=out.device)
                for j in range(n_models):
                    loss_sum[o, j] += float(loss(out[j][sel], target[sel])) * len(sel)
    return correct, loss_sum
