"""Explicit, derived randomness.

Every random choice in fedcluster (partition, client sampling, initial models,
mini-batch order, DP noise, ...) draws from a generator derived from
``(seed, purpose, *keys)`` -- typically ``(seed, "batches", round, client)``.
Nothing depends on global random state or on the order in which clients are
processed, so the same config and seed give the same numbers, also after an
interrupted run is resumed from a checkpoint.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch


def derive_seed(seed: int, purpose: str, *keys: int) -> int:
    """A 63-bit integer that depends only on ``seed``, ``purpose`` and ``keys``."""
    text = f"{int(seed)}|{purpose}|" + "|".join(str(int(k)) for k in keys)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def numpy_rng(seed: int, purpose: str, *keys: int) -> np.random.Generator:
    """A NumPy generator for one purpose (e.g. ``numpy_rng(seed, "partition")``)."""
    return np.random.Generator(np.random.PCG64(derive_seed(seed, purpose, *keys)))


def torch_rng(seed: int, purpose: str, *keys: int) -> torch.Generator:
    """A CPU torch generator for one purpose (e.g. model initialisation)."""
    gen = torch.Generator()
    gen.manual_seed(derive_seed(seed, purpose, *keys))
    return gen
