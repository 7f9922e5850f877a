"""A loaded dataset: its training and test pools of samples and its classes.

What every source returns (:func:`fedcluster.data.sources.load_dataset`, the LEAF
loader) and what partitions split over clients.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Split:
    """One pool of samples.

    Attributes:
        x: float32; images ``[N, C, H, W]`` scaled to [0, 1] (CIFAR-10: normalised
            as its ``normalize`` option says), tabular data ``[N, F]``.
        y: int64 ``[N]``, labels ``0..n_classes-1``.
    """

    x: torch.Tensor
    y: torch.Tensor


@dataclass(frozen=True)
class Dataset:
    """A loaded dataset.

    Attributes:
        name: the name it was loaded by.
        train: the training pool (for single-pool sources: the only pool).
        test: the test pool, or None when the source has a single pool (EMNIST
            without its train files, ``digits``, ``mnist5k``, ``synthetic``);
            partitions then hold out per-client test sets from ``train``.
        classes: class names, index = label.
        client_sizes: for inherently federated sources (``synthetic``) the
            number of samples of each client, whose samples are consecutive rows
            of ``train`` in client order; None otherwise.
    """

    name: str
    train: Split
    test: Split | None
    classes: tuple[str, ...]
    client_sizes: np.ndarray | None = None
    test_client_sizes: np.ndarray | None = None
    """For federated sources with their own test split (LEAF): each client's test
    samples, consecutive rows of ``test`` in client order; None otherwise."""
