"""Packed federation data (client data is packed).

All clients' samples of a split live in one tensor, client ``i`` owning rows
``offsets[i]:offsets[i+1]``; a mini-batch is a gather by index. Per-client
transforms of the partition (rotation, relabelling) are applied once here, so
the training loop never touches Python objects per sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedcluster.data.transforms import rotate_images
from fedcluster.errors import ConfigError, DataError

if TYPE_CHECKING:
    from fedcluster.data.dataset import Dataset
    from fedcluster.data.partitions import Partition


@dataclass
class Federation:
    """The packed train and test data of every client, plus ground truth."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    train_offsets: np.ndarray
    x_test: torch.Tensor
    y_test: torch.Tensor
    test_offsets: np.ndarray
    n_classes: int
    groups: np.ndarray | None = None
    rotations: np.ndarray | None = None
    """Degrees (counter-clockwise) by which each client's images are rotated, where known."""
    revisions: np.ndarray = field(init=False, repr=False, compare=False)
    """Per client, how often its data was changed in place (:meth:`data_changed`);
    caches derived from the data (the simulator's) compare it to stay current."""

    def __post_init__(self) -> None:
        for split, x, y, off in (
            ("train", self.x_train, self.y_train, self.train_offsets),
            ("test", self.x_test, self.y_test, self.test_offsets),
        ):
            if len(x) != len(y) or int(off[-1]) != len(y) or int(off[0]) != 0:
                raise ValueError(f"federation {split} split: offsets do not match {len(y)} samples")
            if np.any(np.diff(off) < 0):
                raise ValueError(f"federation {split} split: offsets must be non-decreasing")
        if len(self.train_offsets) != len(self.test_offsets):
            raise ValueError("federation: train and test splits have different client counts")
        for name in ("groups", "rotations"):
            value = getattr(self, name)
            if value is not None and len(value) != self.n_clients:
                raise ValueError(f"federation: {name} must have one entry per client")
        self.revisions = np.zeros(self.n_clients, dtype=np.int64)

    def data_changed(self, client: int) -> None:
        """Record that client ``client``'s samples or labels were changed in place (drift)."""
        self.revisions[client] += 1

    @property
    def n_clients(self) -> int:
        return len(self.train_offsets) - 1

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def train_sizes(self) -> np.ndarray:
        return np.diff(self.train_offsets)

    @property
    def test_sizes(self) -> np.ndarray:
        return np.diff(self.test_offsets)

    def clone(self) -> Federation:
        """A copy whose tensors and arrays can be changed without touching this one (drift)."""
        return replace(
            self,
            x_train=self.x_train.clone(),
            y_train=self.y_train.clone(),
            x_test=self.x_test.clone(),
            y_test=self.y_test.clone(),
            rotations=None if self.rotations is None else self.rotations.copy(),
        )

    def to(self, device: torch.device | str) -> Federation:
        """This federation with its tensors on ``device`` (itself when they are there
        already, so in-place changes such as drift keep reaching every holder)."""
        device = torch.device(device)
        if self.x_train.device == device:
            return self
        moved = replace(
            self,
            x_train=self.x_train.to(device),
            y_train=self.y_train.to(device),
            x_test=self.x_test.to(device),
            y_test=self.y_test.to(device),
        )
        moved.revisions = self.revisions.copy()
        return moved

    def subset(self, clients: list[int]) -> Federation:
        """A federation of only these clients' data (in this order), e.g. a Flower node's own."""
        train = [
            (self.x_train[self.client_slice(c)], self.y_train[self.client_slice(c)])
            for c in clients
        ]
        test = [
            (self.x_test[self.client_slice(c, "test")], self.y_test[self.client_slice(c, "test")])
            for c in clients
        ]
        groups = None if self.groups is None else self.groups[clients]
        part = Federation.from_clients(train, test, self.n_classes, groups)
        if self.rotations is None:
            return part
        return replace(part, rotations=self.rotations[clients].copy())

    def client_slice(self, client: int, split: str = "train") -> slice:
        off = self.train_offsets if split == "train" else self.test_offsets
        return slice(int(off[client]), int(off[client + 1]))

    @classmethod
    def from_clients(
        cls,
        train: list[tuple[torch.Tensor, torch.Tensor]],
        test: list[tuple[torch.Tensor, torch.Tensor]],
        n_classes: int,
        groups: Sequence[int] | np.ndarray | None = None,
    ) -> Federation:
        """Pack per-client ``(x, y)`` tensors (e.g. a user's own data) into a federation.

        Args:
            train: client i's training inputs and integer labels, one pair per client.
            test: client i's test inputs and labels, in the same client order.
            n_classes: the number of classes (labels are ``0 .. n_classes - 1``).
            groups: optional ground truth, the hidden group of each client: the
                clusters found are then scored against it (purity, ARI, NMI in
                ``metrics.csv``, the heatmap of the report).
        """
        x_tr, y_tr, off_tr = _pack(train)
        x_te, y_te, off_te = _pack(test)
        truth = None if groups is None else np.asarray(groups, dtype=np.int64)
        return cls(x_tr, y_tr, off_tr, x_te, y_te, off_te, n_classes, truth)


def require_integer_labels(y: torch.Tensor, what: str) -> None:
    """DataError naming ``what`` when the labels ``y`` are not integers (float labels
    would be truncated to class indices without a word)."""
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise DataError(f"{what} are {y.dtype}, not integers (class indices)")


def _pack(
    parts: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    for client, (_, y) in enumerate(parts):
        require_integer_labels(y, f"client {client}'s labels")
    sizes = [len(y) for _, y in parts]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    # Token ids (int32/int64, e.g. Sent140's) stay int64; everything else (uint8 images too)
    # becomes float32.
    integer = bool(parts) and all(x.dtype in (torch.int32, torch.int64) for x, _ in parts)
    dtype = torch.int64 if integer else torch.float32
    x = torch.cat([x.to(dtype) for x, _ in parts]).contiguous()
    y = torch.cat([y.to(torch.int64) for _, y in parts]).contiguous()
    return x, y, offsets


def _check_indices(parts: list[np.ndarray], size: int, what: str) -> None:
    """ConfigError naming the first client whose indices are not integers in ``[0, size)``."""
    for client, indices in enumerate(parts):
        idx = np.asarray(indices)
        if idx.size and (idx.dtype.kind not in "iu" or idx.min() < 0 or idx.max() >= size):
            raise ConfigError(
                f"partition: client {client}'s indices are not integers in [0, {size}) "
                f"(the dataset's {size} {what})"
            )


def build_federation(dataset: Dataset, partition: Partition) -> Federation:
    """Gather each client's samples, rotate and relabel them as the partition says, and pack."""
    test_split = dataset.train if partition.test_pool == "train" else dataset.test
    if test_split is None:
        raise ConfigError(
            f"dataset {dataset.name!r} has no test split; the partition's test_pool 'test' "
            "needs one"
        )
    _check_indices(partition.train, len(dataset.train.y), "training samples")
    _check_indices(partition.test, len(test_split.y), f"{partition.test_pool} samples")
    n_classes = len(dataset.classes)
    if partition.label_maps is not None:
        n_classes = int(partition.label_maps.max()) + 1

    def client_data(split, indices, client):
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        x, y = split.x[idx], split.y[idx]
        if partition.rotations is not None and partition.rotations[client] % 360 != 0:
            x = rotate_images(x, float(partition.rotations[client]))
        if partition.label_maps is not None:
            y = torch.as_tensor(partition.label_maps[client])[y]
        return x, y

    train = [client_data(dataset.train, ix, c) for c, ix in enumerate(partition.train)]
    test = [client_data(test_split, ix, c) for c, ix in enumerate(partition.test)]
    federation = Federation.from_clients(train, test, n_classes, partition.groups)
    if partition.rotations is not None:
        federation.rotations = np.asarray(partition.rotations, dtype=np.float64).copy()
    return federation
