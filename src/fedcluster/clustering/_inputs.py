"""Input checks shared by the clustering toolkit: shapes are validated once, here."""

from __future__ import annotations

import numpy as np
import torch

from fedcluster.errors import ConfigError

ArrayLike = torch.Tensor | np.ndarray


def as_rows(x: ArrayLike, name: str) -> torch.Tensor:
    """``x`` as a float64 tensor [n, d] (one client per row), on its own device."""
    t = torch.as_tensor(x)
    if t.ndim != 2 or t.shape[0] == 0:
        raise ConfigError(f"{name}: expected a non-empty 2-D tensor [n, d], got {tuple(t.shape)}")
    return t.to(torch.float64)


def to_numpy(x: ArrayLike) -> np.ndarray:
    """``x`` as a NumPy array (a tensor is detached and copied to the CPU)."""
    return np.asarray(x.detach().cpu() if isinstance(x, torch.Tensor) else x)


def as_array(x: ArrayLike, name: str, ndim: int) -> np.ndarray:
    """``x`` as a non-empty float64 NumPy array with ``ndim`` dimensions."""
    a = to_numpy(x).astype(np.float64, copy=False)
    if a.ndim != ndim or a.shape[0] == 0:
        raise ConfigError(f"{name}: expected a non-empty {ndim}-D array, got shape {a.shape}")
    return a


def as_square(x: ArrayLike, name: str) -> np.ndarray:
    """``x`` as a float64 NumPy array [n, n] (a distance or similarity matrix)."""
    a = as_array(x, name, 2)
    if a.shape[0] != a.shape[1]:
        raise ConfigError(f"{name}: expected a square matrix [n, n], got shape {a.shape}")
    return a


def as_labels(x: ArrayLike, name: str, n: int | None = None) -> np.ndarray:
    """``x`` as an int64 NumPy array [n] of cluster / group labels."""
    a = to_numpy(x)
    if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
        raise ConfigError(
            f"{name}: expected a non-empty 1-D integer array, got {a.dtype} {a.shape}"
        )
    if n is not None and a.size != n:
        raise ConfigError(f"{name}: expected {n} labels, got {a.size}")
    return a.astype(np.int64)
