"""fedcluster's partitions and flwr-datasets' partitioners, each usable from the other side.

- the ``flwr`` partition of :mod:`fedcluster.data.partitions` runs a partitioner of
  ``flwr_datasets.partitioner`` by class name over a run's training labels;
- :class:`FedclusterPartitioner`: any fedcluster partition (JGL's cluster tables,
  CFLGT's label combinations, Dirichlet, rotations, a plugin) as a flwr-datasets
  ``Partitioner``, for users of Flower's data pipeline: ``load_partition(i)`` is
  client i's training data, ``load_test_partition(i)`` the test samples the
  partition holds out of it, ``groups`` the ground-truth clusters.

Needs the optional dependency ``flwr-datasets`` (``pip install 'fedcluster[hf]'``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedcluster.data.partitions import make_partition
from fedcluster.errors import ConfigError

try:
    from flwr_datasets import partitioner as flwr_partitioners
except ImportError:  # pragma: no cover - the optional dependency is missing
    raise ConfigError(
        "flwr-datasets partitioners need the 'flwr-datasets' package (pip install 'fedcluster[hf]')"
    ) from None

LABEL = "label"


class FedclusterPartitioner(flwr_partitioners.Partitioner):
    """A fedcluster partition (``name`` of :data:`~fedcluster.data.partitions.PARTITIONS`
    or a plugin, with its ``options``) as a flwr-datasets ``Partitioner``.

    The partition is drawn once, on first use, from the assigned dataset's
    ``label_column`` with ``np.random.default_rng(seed)``, as
    ``make_partition(name, labels, None, rng, **options)`` draws it: the clients are
    the native partition's. The dataset has one pool, so each client's test samples
    are held out of its own (``load_test_partition``).
    """

    def __init__(
        self, name: str, *, label_column: str = LABEL, seed: int = 0, **options: Any
    ) -> None:
        super().__init__()
        self.name, self.label_column, self.seed, self.options = name, label_column, seed, options
        self._partition: Any = None

    @property
    def partition(self) -> Any:
        """The fedcluster :class:`~fedcluster.data.partitions.Partition` of the dataset."""
        if self._partition is None:
            labels = np.asarray(self.dataset[self.label_column], dtype=np.int64)
            rng = np.random.default_rng(self.seed)
            self._partition = make_partition(self.name, labels, None, rng, **self.options)
        return self._partition

    @property
    def num_partitions(self) -> int:
        return len(self.partition.train)

    @property
    def groups(self) -> np.ndarray | None:
        """Each client's ground-truth cluster, where the partition has one."""
        groups: np.ndarray | None = self.partition.groups
        return groups

    def load_partition(self, partition_id: int) -> Any:
        """Client ``partition_id``'s training samples."""
        return self.dataset.select(self.partition.train[partition_id])

    def load_test_partition(self, partition_id: int) -> Any:
        """The test samples held out of client ``partition_id``'s data."""
        return self.dataset.select(self.partition.test[partition_id])
