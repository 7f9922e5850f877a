"""Each shift of data.shift changes the distribution it names and nothing else, on tiny data
where every sample can be traced back to the pool."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcluster.config.schema import ShiftConfig, resolve_config
from fedcluster.data.configured import Partitioned, load_partitioned
from fedcluster.data.dataset import Dataset, Split
from fedcluster.data.partitions import make_partition
from fedcluster.data.shift import plan_shift, shift_partition
from fedcluster.errors import ConfigError

N_CLASSES = 4


def _dataset(channels: int = 1) -> Dataset:
    gen = torch.Generator().manual_seed(0)
    y_train = torch.arange(80) % N_CLASSES
    y_test = torch.arange(40) % N_CLASSES
    return Dataset(
        "tiny",
        Split(torch.rand(80, channels, 5, 5, generator=gen), y_train),
        Split(torch.rand(40, channels, 5, 5, generator=gen), y_test),
        tuple(str(c) for c in range(N_CLASSES)),
    )


def _shifted(spec: ShiftConfig, channels: int = 1, seed: int = 0):
    data = _dataset(channels)
    rng = np.random.default_rng(seed)
    base = make_partition("iid", data.train.y.numpy(), data.test.y.numpy(), rng, n_clients=8)
    plan = plan_shift(spec, base.groups, base.n_clients, N_CLASSES, channels, rng)
    part = shift_partition(base, data.train.y.numpy(), data.test.y.numpy(), plan, rng)
    return data, base, plan, part, Partitioned(data, part, plan).federation()


def _client(fed, c: int, split: str = "train"):
    rows = fed.client_slice(c, split)
    x, y = (fed.x_train, fed.y_train) if split == "train" else (fed.x_test, fed.y_test)
    return x[rows], y[rows]


def _pool(data: Dataset, idx: np.ndarray, split: str = "train"):
    pool = data.train if split == "train" else data.test
    assert pool is not None
    index = torch.as_tensor(idx)
    return pool.x[index], pool.y[index]


@pytest.mark.parametrize("kind", ["feature", "concept_y_given_x", "concept_x_given_y", "label"])
def test_groups_are_balanced_and_recorded_as_ground_truth(kind: str) -> None:
    _, _, plan, part, fed = _shifted(ShiftConfig(kind=kind, groups=4, labels_per_group=2))
    assert np.bincount(plan.truth, minlength=4).tolist() == [2, 2, 2, 2]
    assert np.array_equal(part.groups, plan.truth) and np.array_equal(fed.groups, plan.truth)


def test_concept_y_given_x_keeps_the_images_and_permutes_labels_per_group() -> None:
    data, base, plan, _, fed = _shifted(ShiftConfig(kind="concept_y_given_x", groups=3))
    assert plan.permutations is not None and plan.concept is not None
    assert np.array_equal(plan.permutations[0], np.arange(N_CLASSES))
    for g in (1, 2):
        assert not np.array_equal(plan.permutations[g], np.arange(N_CLASSES))
        assert sorted(plan.permutations[g]) == list(range(N_CLASSES))
    for c in range(8):
        for split, idx in (("train", base.train[c]), ("test", base.test[c])):
            x, y = _client(fed, c, split)
            x0, y0 = _pool(data, idx, split)
            assert torch.equal(x, x0)  # P(x) unchanged: the very same images
            perm = plan.permutations[plan.concept[c]]
            assert y.tolist() == [int(perm[v]) for v in y0.tolist()]


def test_label_shift_keeps_only_the_groups_classes_with_their_images() -> None:
    data, base, plan, part, fed = _shifted(ShiftConfig(kind="label", groups=2, labels_per_group=2))
    assert plan.class_weights is not None and plan.label is not None
    for c in range(8):
        kept = set(np.flatnonzero(plan.class_weights[plan.label[c]]).tolist())
        assert len(kept) == 2
        x, y = _client(fed, c)
        # P(x|y) unchanged: each kept sample is a pool sample with its own label, and every
        # base sample of a kept class stays (weight 1), every other one goes.
        x0, y0 = _pool(data, part.train[c])
        assert torch.equal(x, x0) and torch.equal(y, y0)
        y_base = data.train.y.numpy()[base.train[c]]
        expected = base.train[c][np.isin(y_base, list(kept))]
        assert np.array_equal(part.train[c], expected)
        assert set(y.tolist()) <= kept


def test_label_shift_by_dirichlet_keeps_samples_by_their_class_weight() -> None:
    spec = ShiftConfig(kind="label", groups=2, alpha=0.5)
    _, _, plan, _, _ = _shifted(spec)
    assert plan.class_weights is not None
    assert np.allclose(plan.class_weights.max(axis=1), 1.0)
    assert (plan.class_weights >= 0).all()


def test_feature_rotation_rotates_each_group_and_keeps_labels() -> None:
    data, base, plan, _, fed = _shifted(ShiftConfig(kind="feature", groups=4))
    assert plan.feature is not None
    for c in range(8):
        x, y = _client(fed, c)
        x0, y0 = _pool(data, base.train[c])
        assert torch.equal(y, y0)
        assert torch.equal(x, torch.rot90(x0, int(plan.feature[c]), dims=(-2, -1)))


def test_feature_contrast_scales_about_each_images_mean() -> None:
    data, base, plan, _, fed = _shifted(ShiftConfig(kind="feature", groups=2, transform="contrast"))
    assert plan.feature is not None
    for c in range(8):
        x, y = _client(fed, c, "test")
        x0, y0 = _pool(data, base.test[c], "test")
        factor = 1.0 / (plan.feature[c] + 1)
        mean = x0.mean(dim=(1, 2, 3), keepdim=True)
        assert torch.equal(y, y0)
        # float32 ops on values in [0, 1]: a few ulps
        assert torch.allclose(x, mean + factor * (x0 - mean), rtol=0, atol=1e-6)


def test_feature_colour_permutes_channels_and_needs_colour_images() -> None:
    data, base, plan, _, fed = _shifted(
        ShiftConfig(kind="feature", groups=3, transform="colour"), channels=3
    )
    assert plan.channel_orders is not None and plan.feature is not None
    for c in range(8):
        x, _ = _client(fed, c)
        x0, _ = _pool(data, base.train[c])
        order = torch.as_tensor(plan.channel_orders[plan.feature[c]])
        assert torch.equal(x, x0[:, order])
    with pytest.raises(ConfigError, match="colour"):
        _shifted(ShiftConfig(kind="feature", groups=3, transform="colour"), channels=1)


def test_concept_x_given_y_rotates_by_group_and_class_and_keeps_labels() -> None:
    data, base, plan, _, fed = _shifted(ShiftConfig(kind="concept_x_given_y", groups=3))
    assert plan.class_angles is not None and plan.concept is not None
    assert (plan.class_angles[0] == 0).all() and (plan.class_angles[1:] % 90 == 0).all()
    for c in range(8):
        x, y = _client(fed, c)
        x0, y0 = _pool(data, base.train[c])
        assert torch.equal(y, y0)  # P(y) unchanged: the same samples and labels
        for i in range(len(y0)):
            turns = int(plan.class_angles[plan.concept[c], int(y0[i])] // 90)
            assert torch.equal(x[i], torch.rot90(x0[i], turns, dims=(-2, -1)))


def test_mixture_has_all_three_shifts_and_the_concept_as_truth() -> None:
    data, base, plan, part, fed = _shifted(ShiftConfig(kind="mixture", groups=2))
    assert plan.label is not None and plan.feature is not None and plan.concept is not None
    assert np.array_equal(plan.truth, plan.concept)
    assert plan.permutations is not None
    for c in range(8):
        x, y = _client(fed, c)
        x0, y0 = _pool(data, part.train[c])
        perm = plan.permutations[plan.concept[c]]
        assert y.tolist() == [int(perm[v]) for v in y0.tolist()]
        turns = int(round(360.0 * plan.feature[c] / 2 / 90))
        assert torch.equal(x, torch.rot90(x0, turns, dims=(-2, -1)))
        assert set(part.train[c]) <= set(base.train[c])


def test_shift_from_the_config_is_deterministic_per_seed() -> None:
    cfg = resolve_config(
        sets=[
            "data.dataset=digits",
            "data.partition={name: iid, n_clients: 6}",
            "data.shift={kind: mixture, groups: 3}",
        ]
    )
    a, b = load_partitioned(cfg, 0), load_partitioned(cfg, 0)
    assert a.shift is not None and b.shift is not None
    assert np.array_equal(a.partition.groups, b.shift.concept)
    assert torch.equal(a.federation().y_train, b.federation().y_train)
    c = load_partitioned(cfg, 1)
    assert not torch.equal(a.federation().y_train, c.federation().y_train)


def test_bad_shift_settings_are_one_line_errors() -> None:
    with pytest.raises(ConfigError, match="data.shift.groups"):
        _shifted(ShiftConfig(kind="feature", groups=9))
    with pytest.raises(ConfigError, match="labels_per_group"):
        _shifted(ShiftConfig(kind="label", groups=2, labels_per_group=5))
    with pytest.raises(ConfigError, match="data.shift"):
        resolve_config(sets=["data.shift={kind: sideways}"])


def test_a_base_partitions_groups_combine_with_the_shift_groups() -> None:
    data = _dataset()
    rng = np.random.default_rng(1)
    y_train, y_test = data.train.y.numpy(), data.test.y.numpy()
    base = make_partition(
        "rotation", y_train, y_test, rng, n_groups=2, base_options={"n_clients": 8}
    )
    spec = ShiftConfig(kind="feature", groups=2, transform="contrast")
    plan = plan_shift(spec, base.groups, base.n_clients, N_CLASSES, 1, rng)
    assert plan.feature is not None and base.groups is not None
    pairs = list(zip(base.groups.tolist(), plan.feature.tolist(), strict=True))
    # one truth per (base group, shift group) pair, and each pair present (stratified dealing)
    assert len(set(pairs)) == 4 and len(set(plan.truth.tolist())) == 4
    for a, b in zip(pairs, plan.truth.tolist(), strict=True):
        assert all((p == a) == (t == b) for p, t in zip(pairs, plan.truth.tolist(), strict=True))
    # the base's rotations stay; the mixture's truth is the concept alone
    part = shift_partition(base, y_train, y_test, plan, rng)
    assert np.array_equal(part.rotations, base.rotations)
    mixture = plan_shift(ShiftConfig(kind="mixture", groups=2), base.groups, 8, N_CLASSES, 1, rng)
    assert np.array_equal(mixture.truth, mixture.concept)


def test_a_feature_rotation_adds_to_the_base_partitions_rotation() -> None:
    data = _dataset()
    rng = np.random.default_rng(2)
    y_train, y_test = data.train.y.numpy(), data.test.y.numpy()
    base = make_partition(
        "rotation", y_train, y_test, rng, angles=[0, 90], base_options={"n_clients": 8}
    )
    plan = plan_shift(ShiftConfig(kind="feature", groups=2), base.groups, 8, N_CLASSES, 1, rng)
    part = shift_partition(base, y_train, y_test, plan, rng)
    assert plan.feature is not None and base.rotations is not None
    assert np.array_equal(part.rotations, (base.rotations + 180.0 * plan.feature) % 360.0)
    fed = Partitioned(data, part, plan).federation()
    for c in range(8):
        x, _ = _client(fed, c)
        x0, _ = _pool(data, base.train[c])
        turns = int(part.rotations[c] // 90)
        assert torch.equal(x, torch.rot90(x0, turns, dims=(-2, -1)))
