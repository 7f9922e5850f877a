"""Distribution shifts between client groups, on top of any dataset and partition.

The four kinds of shift -- P(x), P(y), P(y|x), P(x|y) -- of FedRC (Guo, Tang and
Lin, "FedRC: Tackling Diverse Distribution Shifts Challenge in Federated Learning by
Robust Clustering", ICML 2024: its problem setting and experimental setup) and of
FLUX (Fenoglio et al., "FLUX: Efficient Descriptor-Driven Clustered Federated
Learning under Arbitrary Distribution Shifts", NeurIPS 2025), one per
``data.shift.kind``. The clients of a
partition are dealt into ``groups`` groups (sizes differing by at most one, within
each group of the base partition when it has some); then, for the clients of group g:

- ``feature`` -- P(x) changes, P(y|x) stays: the images are rotated by 360·g/K
  degrees (``transform: rotate``, the rotated-data setting of IFCA), their contrast
  scaled by 1/(g+1) (``contrast``, :func:`~fedcluster.data.transforms.scale_contrast`)
  or their colour channels permuted (``colour``, a fixed permutation per group,
  the identity for group 0);
- ``label`` -- P(y) changes, P(x|y) stays: each sample of class c is kept with
  probability w_g[c] / max_c w_g[c], the group's class weights w_g ~ Dirichlet(alpha)
  or, with ``labels_per_group`` L, 1 for L random classes and 0 for the others
  (train and test alike, so each client is tested on its own distribution);
- ``concept_y_given_x`` -- P(y|x) changes, P(x) stays: the labels go through a
  permutation of the classes per group (the identity for group 0, another random one
  for each other group), FedRC's label-swapping concept shift;
- ``concept_x_given_y`` -- P(x|y) changes, P(y) stays: the images of class c are
  rotated by a multiple of 90 degrees that depends on (g, c) (all 0 for group 0);
- ``mixture`` -- FedRC's simultaneous shifts: a label, a feature and a
  ``concept_y_given_x`` shift, each with its own independent grouping. FedRC's
  clustering principle is that clusters should separate concepts only, so the
  ground truth is the concept group.

The ground truth (``Partition.groups``) is the shift group, combined with the base
partition's groups where it has some (as :func:`~fedcluster.data.partitions.rotation`
combines them), except for ``mixture``; purity, ARI and NMI are measured against it.
Every random choice draws from the generator passed in (``numpy_rng(seed, "shift")``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from fedcluster.config.schema import ShiftConfig
from fedcluster.data.federation import Federation
from fedcluster.data.partitions import Partition, _balanced_groups
from fedcluster.data.transforms import permute_channels, rotate_images, scale_contrast
from fedcluster.errors import ConfigError

__all__ = ["ShiftPlan", "plan_shift", "shift_images", "shift_partition"]


@dataclass(frozen=True)
class ShiftPlan:
    """Who is in which group for each component of a shift, and each group's parameters.

    ``feature``, ``label``, ``concept``: the group of each client for that component
    (None: the shift has none); ``truth``: the ground truth of each client.
    """

    spec: ShiftConfig
    truth: np.ndarray
    feature: np.ndarray | None = None
    label: np.ndarray | None = None
    concept: np.ndarray | None = None
    class_weights: np.ndarray | None = None
    """[K, C] the probability of keeping a sample of each class (label shift)."""
    permutations: np.ndarray | None = None
    """[K, C] the label each class becomes (concept_y_given_x)."""
    class_angles: np.ndarray | None = None
    """[K, C] degrees by which the images of each class are rotated (concept_x_given_y)."""
    channel_orders: np.ndarray | None = None
    """[K, channels] the channel order of each group (feature shift ``colour``)."""


def plan_shift(
    spec: ShiftConfig,
    base_groups: np.ndarray | None,
    n_clients: int,
    n_classes: int,
    n_channels: int,
    rng: np.random.Generator,
) -> ShiftPlan:
    """The groups and per-group parameters of ``spec`` for ``n_clients`` clients."""
    k, kind = spec.groups, spec.kind
    if k > n_clients:
        raise ConfigError(
            f"data.shift.groups: {k} groups for {n_clients} clients would leave groups empty"
        )
    strata = np.zeros(n_clients, dtype=np.int64) if base_groups is None else base_groups
    parts: dict[str, np.ndarray | None] = {"feature": None, "label": None, "concept": None}
    for part in ("label", "feature", "concept"):
        if kind == "mixture" or kind.startswith(part):
            parts[part] = _balanced_groups(strata, k, rng)
    concept = parts["concept"]
    truth = concept if kind == "mixture" and concept is not None else _only(parts)
    if kind != "mixture" and base_groups is not None:
        truth = np.unique(base_groups * k + truth, return_inverse=True)[1].reshape(-1)
    weights = None if parts["label"] is None else _class_weights(spec, n_classes, rng)
    permutations = orders = angles = None
    if kind in ("concept_y_given_x", "mixture"):
        permutations = _non_identity(k, n_classes, rng)
    if kind == "concept_x_given_y":
        angles = 90.0 * rng.integers(1, 4, size=(k, n_classes))
        angles[0] = 0.0
    if parts["feature"] is not None and spec.transform == "colour":
        if n_channels < 2:
            raise ConfigError(
                f"data.shift.transform: 'colour' permutes colour channels; the images have "
                f"{n_channels} channel"
            )
        orders = _non_identity(k, n_channels, rng)
    return ShiftPlan(
        spec, truth, parts["feature"], parts["label"], concept, weights, permutations, angles,
        orders,
    )  # fmt: skip


def _only(parts: dict[str, np.ndarray | None]) -> np.ndarray:
    (groups,) = [g for g in parts.values() if g is not None]
    return groups


def _class_weights(spec: ShiftConfig, n_classes: int, rng: np.random.Generator) -> np.ndarray:
    """[K, C] keep-probabilities: Dirichlet(alpha) weights over their maximum, or
    ``labels_per_group`` classes kept whole."""
    k = spec.groups
    if spec.labels_per_group is None:
        weights = rng.dirichlet(np.full(n_classes, spec.alpha), size=k)
        return weights / weights.max(axis=1, keepdims=True)
    if spec.labels_per_group > n_classes:
        raise ConfigError(
            f"data.shift.labels_per_group: {spec.labels_per_group} classes per group, but the "
            f"dataset has {n_classes}"
        )
    weights = np.zeros((k, n_classes))
    for g in range(k):
        weights[g, rng.choice(n_classes, spec.labels_per_group, replace=False)] = 1.0
    return weights


def _non_identity(k: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """[k, n]: the identity, then k − 1 random permutations of n items, none the identity."""
    rows = [np.arange(n)]
    while len(rows) < k:
        perm = rng.permutation(n)
        if not np.array_equal(perm, rows[0]):
            rows.append(perm)
    return np.stack(rows)


def shift_partition(
    partition: Partition,
    y_train: np.ndarray,
    y_test_pool: np.ndarray,
    plan: ShiftPlan,
    rng: np.random.Generator,
) -> Partition:
    """``partition`` with the plan's label shift (samples dropped by class), rotations
    (feature ``rotate``), label maps (concept P(y|x)) and ground truth applied; the
    images' other changes come with :func:`shift_images`. ``y_test_pool`` holds the
    labels the test indices point to."""
    train, test = partition.train, partition.test
    if plan.label is not None and plan.class_weights is not None:
        keep = plan.class_weights[plan.label]
        train = [ix[rng.random(len(ix)) < keep[i][y_train[ix]]] for i, ix in enumerate(train)]
        test = [ix[rng.random(len(ix)) < keep[i][y_test_pool[ix]]] for i, ix in enumerate(test)]
    rotations = partition.rotations
    if plan.feature is not None and plan.spec.transform == "rotate":
        angles = 360.0 * plan.feature / plan.spec.groups
        rotations = angles if rotations is None else (rotations + angles) % 360.0
    label_maps = partition.label_maps
    if plan.permutations is not None and plan.concept is not None:
        if label_maps is not None:
            raise ConfigError(
                f"data.shift.kind: {plan.spec.kind!r} permutes labels, and the partition "
                "relabels them already; choose a partition without relabelling"
            )
        label_maps = plan.permutations[plan.concept]
    return replace(
        partition,
        train=train,
        test=test,
        groups=plan.truth,
        rotations=rotations,
        label_maps=label_maps,
    )


def shift_images(federation: Federation, plan: ShiftPlan) -> None:
    """Apply, in place, the plan's image changes that depend on more than the client
    (feature ``contrast`` and ``colour``, class-conditional rotations)."""
    transform = plan.spec.transform
    for client in range(federation.n_clients):
        for x, y, split in (
            (federation.x_train, federation.y_train, "train"),
            (federation.x_test, federation.y_test, "test"),
        ):
            rows = federation.client_slice(client, split)
            if plan.feature is not None and transform != "rotate":
                group = int(plan.feature[client])
                if transform == "contrast":
                    x[rows] = scale_contrast(x[rows], 1.0 / (group + 1))
                elif plan.channel_orders is not None:
                    x[rows] = permute_channels(x[rows], plan.channel_orders[group])
            if plan.class_angles is not None and plan.concept is not None:
                _rotate_by_class(x, y, rows, plan.class_angles[int(plan.concept[client])])


def _rotate_by_class(x: torch.Tensor, y: torch.Tensor, rows: slice, angles: np.ndarray) -> None:
    """Rotate the images of ``rows`` whose label is c by ``angles[c]`` degrees, in place."""
    labels = y[rows]
    block = x[rows]
    for c in torch.unique(labels).tolist():
        if angles[c] % 360.0:
            mask = labels == c
            block[mask] = rotate_images(block[mask], float(angles[c]))
    x[rows] = block
