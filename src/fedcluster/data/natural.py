"""The ``natural`` partition: a federated dataset's own clients become the federation's.

Sources that are federated by construction -- Synthetic(alpha, beta) (FedProx,
Li et al. 2020, Sec. 5.1; FedGroup Sec. V-A) and LEAF's FEMNIST and Sent140
(:mod:`fedcluster.data.leaf`; FedGroup Table II) -- list each client's sample
count in ``Dataset.client_sizes``, its samples being consecutive rows of the
train pool. This partition keeps those clients as they are:

* with the dataset's own test split (LEAF: ``Dataset.test_client_sizes``) each
  client tests on its own test rows;
* without one (``synthetic``) each client's test set is held out of its own
  samples, class by class, like every partition of a single-pool dataset
  (``test_fraction``, default 0.2, or ``test_size``; FedProx's generator holds
  out 10 %, so the FedGroup presets set ``test_fraction: 0.1``).

There is no ground-truth grouping (``groups`` is None).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedcluster.data.dataset import Dataset
from fedcluster.data.partitions import Partition, _hold_out, _int_option
from fedcluster.errors import ConfigError

NATURAL = "natural"


def _ranges(sizes: np.ndarray) -> list[np.ndarray]:
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return [np.arange(offsets[i], offsets[i + 1]) for i in range(len(sizes))]


def natural_partition(
    dataset: Dataset,
    rng: np.random.Generator,
    *,
    test_fraction: float | None = None,
    test_size: int | None = None,
) -> Partition:
    """One client per client of ``dataset`` (see the module docstring).

    Raises:
        ConfigError: the dataset has no clients of its own, or a test option is
            given for a dataset that brings its own test split.
    """
    if dataset.client_sizes is None:
        raise ConfigError(
            f"partition 'natural' needs a federated dataset (synthetic, leaf-femnist, "
            f"leaf-sent140); {dataset.name!r} has no clients of its own"
        )
    train = _ranges(np.asarray(dataset.client_sizes))
    if dataset.test_client_sizes is not None:
        if test_fraction is not None or test_size is not None:
            raise ConfigError(
                f"partition 'natural': {dataset.name!r} brings its own test split; "
                "test_fraction and test_size do not apply"
            )
        return Partition(train, _ranges(np.asarray(dataset.test_client_sizes)), "test")
    if test_size is not None:
        test_size = _int_option("test_size", test_size)
    kept, held = _hold_out(train, dataset.train.y.numpy(), rng, test_size, None, test_fraction)
    return Partition(kept, held, "train")


def make_natural(dataset: Dataset, rng: np.random.Generator, options: dict[str, Any]) -> Partition:
    """:func:`natural_partition` with config options, unknown ones rejected by name."""
    allowed = ("test_fraction", "test_size")
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(
            f"partition 'natural' has no option {unknown[0]!r}; allowed: {list(allowed)}"
        )
    return natural_partition(dataset, rng, **options)
