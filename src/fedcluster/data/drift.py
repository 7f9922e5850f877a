"""Client data drift, applied to a packed federation in place.

DCFL (Augello et al. 2023, Sec. III): "starting from the
fifth communication round and every ten rounds after that a client is
randomly selected and its data distribution is altered by changing the
rotation angle". Three kinds of change, each keeping the client's sample
counts so the federation's offsets stay valid:

- ``rotate``: the client's train and test images are rotated by a further
  ``angle`` degrees (:func:`~fedcluster.data.transforms.rotate_images`; exact
  for multiples of 90, else one more bilinear interpolation of the current
  images) and ``Federation.rotations`` is updated;
- ``swap_labels``: two labels trade places in the client's train and test labels
  (label preference skew, DCFL Sec. I);
- ``redistribute``: the client's samples are redrawn from the dataset's pool
  (:class:`DriftPool`) with a new label distribution q ~ Dir(``alpha``), the
  same train and test counts, its current rotation and label map. The new
  train and test samples of the client are disjoint; they may coincide with
  other clients' samples.

What drifts when is decided by :class:`fedcluster.experiment.scenario.Scenario`; each
event carries a seed for its own random choices, so replaying the events of a
run on a fresh copy of the federation gives the same data (resume).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from fedcluster.config.schema import DriftKind
from fedcluster.data.dataset import Dataset
from fedcluster.data.federation import Federation
from fedcluster.data.partitions import Partition, _apportion, _dirichlet_per_client, _draw_by_counts
from fedcluster.data.transforms import rotate_images
from fedcluster.errors import ConfigError


@dataclass(frozen=True)
class DriftEvent:
    """One change of one client's data at the start of ``round``.

    ``angle`` (rotate) and ``labels`` (swap_labels) may be ``None``: they are
    then drawn from the event's own generator, seeded by ``seed``.
    """

    round: int
    client: int
    kind: DriftKind
    seed: int
    angle: float | None = None
    labels: tuple[int, int] | None = None
    alpha: float = 1.0
    regroup: tuple[tuple[int, int], ...] = ()
    """(group before, group after) pairs: the client's ground truth after the event, kept
    by the server (:meth:`moved_group`); the client's data does not depend on it."""

    def rng(self) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64(self.seed))


@dataclass(frozen=True)
class DriftPool:
    """The dataset and partition a federation was built from (what ``redistribute`` draws on)."""

    dataset: Dataset
    partition: Partition


def _angle(event: DriftEvent) -> float:
    """A rotation's angle: the configured one, else uniform in [0, 360) from the event's seed."""
    return float(event.rng().uniform(0.0, 360.0)) if event.angle is None else float(event.angle)


def moved_group(groups: np.ndarray | None, event: DriftEvent) -> str | None:
    """Move the event's client to its new ground-truth group in ``groups``, in place, as
    ``event.regroup`` says; a description of the move (None: no move)."""
    if not event.regroup:
        return None
    if groups is None:
        raise ConfigError("scenario.drift.regroup: the federation has no ground-truth groups")
    before = int(groups[event.client])
    after = dict(event.regroup).get(before)
    if after is None or after == before:
        return None
    groups[event.client] = after
    return f"group {before} -> {after}"


def planned_detail(event: DriftEvent) -> str | None:
    """The description :func:`apply_drift` returns, where it does not depend on the
    client's data (``rotate``; ``swap_labels`` with its labels given), else None."""
    if event.kind == "rotate":
        return f"rotated by {_angle(event):.1f} degrees"
    if event.kind == "swap_labels" and event.labels is not None:
        return "swapped labels {} and {}".format(*event.labels)
    return None


def apply_drift(federation: Federation, event: DriftEvent, pool: DriftPool | None = None) -> str:
    """Apply ``event`` to ``federation`` in place; returns a one-line description."""
    rng = event.rng()
    client = event.client
    if event.kind == "rotate":
        rotate_client(federation, client, _angle(event))
        return str(planned_detail(event))
    if event.kind == "swap_labels":
        a, b = event.labels if event.labels is not None else _two_labels(federation, client, rng)
        swap_client_labels(federation, client, a, b)
        return f"swapped labels {a} and {b}"
    if pool is None:
        raise ConfigError(
            "scenario.drift: 'redistribute' redraws samples from the config's dataset; "
            "it is not available for a federation passed in directly"
        )
    counts = redraw_client(federation, client, pool, event.alpha, rng)
    return "new label counts " + " ".join(f"{c}:{n}" for c, n in enumerate(counts) if n)


@dataclass
class DriftReplay:
    """One client's data as of the drift events it was told, kept where the data is.

    A Flower node holds the client's one-client ``federation``; every message
    carries the client's drift events of the job so far. :meth:`follow`
    applies the ones not yet applied, or, when the list is not a continuation
    of what was applied (a new job, whose data starts undrifted), restores the
    data as exported and applies them all. Each event draws from its own seed,
    so the data equals the simulator's copy after the same events.
    """

    federation: Federation
    original: Federation | None = None
    applied: tuple[int, ...] = ()

    def follow(self, events: list[DriftEvent]) -> None:
        """Bring the data to ``events`` (the client's events in order; client 0 here)."""
        seeds = tuple(e.seed for e in events)
        if seeds == self.applied:
            return
        fed = self.federation
        if self.original is None:
            self.original = fed.clone()
        if seeds[: len(self.applied)] != self.applied:
            for name in ("x_train", "y_train", "x_test", "y_test"):
                getattr(fed, name).copy_(getattr(self.original, name))
            if fed.rotations is not None and self.original.rotations is not None:
                fed.rotations[:] = self.original.rotations
            fed.data_changed(0)
            self.applied = ()
        for event in events[len(self.applied) :]:
            apply_drift(fed, replace(event, client=0))
        self.applied = seeds


def rotate_client(federation: Federation, client: int, degrees: float) -> None:
    """Rotate client ``client``'s train and test images by ``degrees`` more, in place."""
    if federation.x_train.ndim != 4:
        raise ConfigError("scenario.drift: 'rotate' needs image data [N, C, H, W]")
    for x, split in ((federation.x_train, "train"), (federation.x_test, "test")):
        rows = federation.client_slice(client, split)
        x[rows] = rotate_images(x[rows], degrees)
    if federation.rotations is not None:
        federation.rotations[client] = (federation.rotations[client] + degrees) % 360.0
    federation.data_changed(client)


def swap_client_labels(federation: Federation, client: int, a: int, b: int) -> None:
    """Exchange labels ``a`` and ``b`` in client ``client``'s train and test labels, in place."""
    if max(a, b) >= federation.n_classes:
        raise ConfigError(
            f"scenario.drift.labels: labels must be below {federation.n_classes}, got {a}, {b}"
        )
    for y, split in ((federation.y_train, "train"), (federation.y_test, "test")):
        part = y[federation.client_slice(client, split)]
        is_a, is_b = part == a, part == b
        part[is_a], part[is_b] = b, a
    federation.data_changed(client)


def _two_labels(federation: Federation, client: int, rng: np.random.Generator) -> tuple[int, int]:
    """Two distinct random labels, preferring the ones the client holds."""
    held = np.unique(federation.y_train[federation.client_slice(client)].numpy())
    if len(held) < 2:
        held = np.arange(federation.n_classes)
    a, b = rng.choice(held, 2, replace=False)
    return int(a), int(b)


def redraw_client(
    federation: Federation,
    client: int,
    pool: DriftPool,
    alpha: float,
    rng: np.random.Generator,
) -> np.ndarray:
    """Replace client ``client``'s samples by a fresh Dirichlet(``alpha``) draw; its class counts.

    Train and test counts stay; the test set follows the new train
    proportions (largest remainders). The new images get the client's current
    rotation and label map (from ``federation.rotations`` and the partition).
    """
    data, part = pool.dataset, pool.partition
    n_train = int(federation.train_sizes[client])
    n_test = int(federation.test_sizes[client])
    test_split = data.train if part.test_pool == "train" else data.test
    if test_split is None:
        raise ConfigError(f"scenario.drift: dataset {data.name!r} has no test split to redraw from")
    y_pool = data.train.y.numpy()
    n_classes = int(y_pool.max()) + 1
    available = np.bincount(y_pool, minlength=n_classes)
    if part.label_maps is not None:
        available[part.label_maps[client][:n_classes] < 0] = 0
    if part.test_pool == "train":  # one pool: draw train and test together, disjoint
        total = _dirichlet_per_client(available, 1, n_train + n_test, alpha, rng)[0]
        test = _apportion(total[None], np.array([n_test]))[0]
        counts = np.stack([total - test, test])
        train_idx, test_idx = _draw_by_counts(y_pool, counts, rng, "scenario.drift")
    else:
        train_counts = _dirichlet_per_client(available, 1, n_train, alpha, rng)
        test_counts = _apportion(train_counts, np.array([n_test]))
        (train_idx,) = _draw_by_counts(y_pool, train_counts, rng, "scenario.drift")
        (test_idx,) = _draw_by_counts(test_split.y.numpy(), test_counts, rng, "scenario.drift")
    angle = 0.0 if federation.rotations is None else float(federation.rotations[client])
    for split, source, idx, x, y in (
        ("train", data.train, train_idx, federation.x_train, federation.y_train),
        ("test", test_split, test_idx, federation.x_test, federation.y_test),
    ):
        index = torch.as_tensor(idx, dtype=torch.int64)
        images, labels = source.x[index], source.y[index]
        if angle % 360.0 != 0.0:
            images = rotate_images(images, angle)
        if part.label_maps is not None:
            labels = torch.as_tensor(part.label_maps[client])[labels]
        rows = federation.client_slice(client, split)
        x[rows], y[rows] = images, labels
    federation.data_changed(client)
    return np.bincount(y_pool[train_idx], minlength=n_classes)
