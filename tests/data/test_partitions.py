"""Partitions: JGL tables on real MNIST labels, CFLGT scenarios, Dirichlet, shards, rotations."""

from __future__ import annotations

import gzip
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcluster.data.partitions import (
    PARTITIONS,
    Partition,
    jgl_emnist_table,
    jgl_table,
    make_partition,
    with_rotations,
)
from fedcluster.data.transforms import relabel
from fedcluster.errors import ConfigError
from fedcluster.rng import numpy_rng


def _idx_labels(path: Path) -> np.ndarray:
    """Labels of an IDX1 file (8-byte header), read directly; skip when absent (fail on CI)."""
    if not path.exists():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"MNIST labels not found at {path} (CI=true: real datasets are required)")
        pytest.skip(f"MNIST labels not found at {path}")
    with gzip.open(path, "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8, offset=8).astype(np.int64)


@pytest.fixture(scope="module")
def mnist(shared_data_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    folder = shared_data_dir / "mnist"
    return (
        _idx_labels(folder / "train-labels-idx1-ubyte.gz"),
        _idx_labels(folder / "t10k-labels-idx1-ubyte.gz"),
    )


def _synthetic(n_per_class: int, n_classes: int = 10, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(n_classes), n_per_class))


def _rng(seed: int = 0) -> np.random.Generator:
    return numpy_rng(seed, "partition")


def _class_counts(y: np.ndarray, parts: list[np.ndarray], n_classes: int) -> np.ndarray:
    return np.stack([np.bincount(y[p], minlength=n_classes) for p in parts])


def _assert_disjoint(parts: list[np.ndarray]) -> None:
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined), "an index is used twice within a split"


def test_jgl_tables_are_fig2() -> None:
    mnist = jgl_table("mnist")
    assert mnist.shape == (4, 10)
    assert mnist.sum(axis=1).tolist() == [17500, 14500, 14500, 13500]
    assert mnist[0].tolist() == [1500, 1500, 1500, 2000, 1500, 2000, 1500, 0, 6000, 0]
    assert jgl_table("fashion-mnist").sum(axis=1).tolist() == [14500, 15500, 14500, 15500]
    cifar = jgl_table("cifar10")
    assert cifar.sum(axis=1).tolist() == [12498, 12500, 13334, 11668]
    assert cifar.sum(axis=0).tolist() == [5000] * 10
    for table in (mnist, jgl_table("fashion-mnist"), cifar):
        assert ((table > 0).sum(axis=1) == 8).all()  # 8 of the 10 classes per cluster
    with pytest.raises(ConfigError, match="jgl_table"):
        jgl_table("svhn")


def test_jgl_mnist_cluster_table_on_real_labels(mnist: tuple[np.ndarray, np.ndarray]) -> None:
    y_train, y_test = mnist
    p = make_partition("cluster_table", y_train, y_test, _rng(), table="jgl-mnist", scale=0.5)
    table = np.rint(jgl_table("mnist") * 0.5).astype(np.int64)
    assert p.n_clients == 80 and p.test_pool == "test"
    assert p.groups.tolist() == np.repeat(np.arange(4), 20).tolist()
    counts = _class_counts(y_train, p.train, 10)
    for k in range(4):
        members = counts[p.groups == k]
        assert members.sum(axis=0).tolist() == table[k].tolist()  # Fig. 2 row, exactly
        assert (members.max(axis=0) - members.min(axis=0) <= 1).all()  # per class
        assert np.ptp(members.sum(axis=1)) <= 1  # and in total
    _assert_disjoint(p.train)
    _assert_disjoint(p.test)  # the test split suffices at this scale: no reuse
    test_counts = _class_counts(y_test, p.test, 10)
    assert ((test_counts > 0) <= (counts > 0)).all()


def test_full_scale_jgl_mnist_shrinks_short_classes(mnist: tuple[np.ndarray, np.ndarray]) -> None:
    y_train, y_test = mnist
    with pytest.warns(UserWarning, match="class 5: 6000 > 5421"):
        p = make_partition("cluster_table", y_train, y_test, _rng())
    counts = _class_counts(y_train, p.train, 10)
    assert counts[:, 5].sum() == 5421 and counts[:, 3].sum() == 6000
    _assert_disjoint(p.train)
    with pytest.raises(ConfigError, match="'table'.*class 0: 6000 > 5923"):
        make_partition("cluster_table", y_train, y_test, _rng(), shortage="error")


def test_test_sets_follow_client_proportions(mnist: tuple[np.ndarray, np.ndarray]) -> None:
    y_train, y_test = mnist
    p = make_partition("dirichlet", y_train, y_test, _rng(), n_clients=30, test_size=40)
    train = _class_counts(y_train, p.train, 10)
    test = _class_counts(y_test, p.test, 10)
    assert (test.sum(axis=1) == 40).all()
    quota = 40 * train / train.sum(axis=1, keepdims=True)
    assert (np.abs(test - quota) < 1).all()
    _assert_disjoint(p.test)


def test_relabel_maps_each_cluster_to_0_7(mnist: tuple[np.ndarray, np.ndarray]) -> None:
    y_train, y_test = mnist
    p = make_partition(
        "cluster_table", y_train, y_test, _rng(), table="jgl-mnist", scale=0.1, relabel=True
    )
    held = jgl_table("mnist") > 0
    for i in range(p.n_clients):
        row = p.label_maps[i]
        classes = np.flatnonzero(held[p.groups[i]])
        assert row[classes].tolist() == list(range(8))
        assert (row[~held[p.groups[i]]] == -1).all()
        local = relabel(torch.as_tensor(y_train[p.train[i]]), row)
        assert set(local.tolist()) <= set(range(8))


@pytest.mark.parametrize(("scenario", "combos", "labels"), [(1, 5, 2), (2, 5, 5), (3, 20, 3)])
def test_label_combination_scenarios(scenario: int, combos: int, labels: int) -> None:
    y = _synthetic(5000)  # CIFAR-10's count: enough even if one label is in every combination
    p = make_partition("label_combinations", y, _synthetic(300, seed=1), _rng(), scenario=scenario)
    assert p.n_clients == 100
    assert np.bincount(p.groups).tolist() == [100 // combos] * combos
    counts = _class_counts(y, p.train, 10)
    assert ((counts == 50) | (counts == 0)).all() and ((counts > 0).sum(axis=1) == labels).all()
    label_sets = {
        g: {tuple(np.flatnonzero(c)) for c in counts[p.groups == g]} for g in range(combos)
    }
    assert all(len(s) == 1 for s in label_sets.values())
    assert len({next(iter(s)) for s in label_sets.values()}) == combos  # distinct combinations
    _assert_disjoint(p.train)


def test_dirichlet_is_determined_by_the_generator() -> None:
    y, y_test = _synthetic(500), _synthetic(100, seed=1)

    def train(seed: int) -> list[np.ndarray]:
        return make_partition("dirichlet", y, y_test, _rng(seed), n_clients=20, alpha=1.0).train

    same, other = train(3), train(4)
    assert all(np.array_equal(a, b) for a, b in zip(train(3), same, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(same, other, strict=True))
    assert [len(t) for t in same] == [250] * 20
    assert make_partition("dirichlet", y, y_test, _rng(), n_clients=20).groups is None


def test_dirichlet_per_label_and_held_out_tests() -> None:
    y = _synthetic(400)
    p = make_partition("dirichlet", y, None, _rng(), n_clients=10, draw="label", min_samples=50)
    assert p.test_pool == "train"
    _assert_disjoint(p.train + p.test)  # test sets are held out of the train pool
    assert sum(len(a) + len(b) for a, b in zip(p.train, p.test, strict=True)) == len(y)
    for tr, te in zip(p.train, p.test, strict=True):
        assert len(tr) >= 1 and abs(len(te) - 0.2 * (len(tr) + len(te))) <= 1
        assert set(y[te]) <= set(y[tr])


def test_shards_consecutive_classes_and_power_law(mnist: tuple[np.ndarray, np.ndarray]) -> None:
    y_train, y_test = mnist
    p = make_partition("shards_powerlaw", y_train, y_test, _rng(), n_clients=200)
    counts = _class_counts(y_train, p.train, 10)
    for i in range(200):
        assert set(np.flatnonzero(counts[i])) == {i % 10, (i + 1) % 10}
    assert p.groups.tolist() == [i % 10 for i in range(200)]
    assert counts[counts > 0].min() >= 5
    assert counts.sum() == len(y_train)  # every sample used, none twice
    _assert_disjoint(p.train)
    sizes = counts.sum(axis=1)
    assert sizes.max() > 10 * np.median(sizes)  # heavy-tailed sizes
    q = make_partition("shards_powerlaw", y_train, y_test, _rng(), n_clients=50, consecutive=False)
    assert ((_class_counts(y_train, q.train, 10) > 0).sum(axis=1) == 2).all()


def test_iid_split() -> None:
    y = _synthetic(101)
    p = make_partition("iid", y, _synthetic(20), _rng(), n_clients=7)
    assert np.ptp([len(t) for t in p.train]) <= 1 and p.groups is None
    _assert_disjoint(p.train)
    assert sum(len(t) for t in p.train) == len(y)


def test_rotation_groups_and_composition() -> None:
    y, y_test = _synthetic(200), _synthetic(50, seed=1)
    p = make_partition("rotation", y, y_test, _rng(), base_options={"n_clients": 10})
    assert sorted(set(p.rotations.tolist())) == [0.0, 90.0, 180.0, 270.0]
    assert np.ptp(np.bincount(p.groups)) <= 1
    assert all(np.ptp(p.rotations[p.groups == g]) == 0 for g in range(4))
    stratified = make_partition(
        "rotation",
        y,
        y_test,
        _rng(),
        base="label_combinations",
        base_options={"scenario": 1, "n_clients": 40, "samples_per_label": 5},
        angles=[0, 180],
    )
    assert np.bincount(stratified.groups).tolist() == [4] * 10  # 5 combos x 2 angles
    dcfl = make_partition("per_client_rotation", y, None, _rng(), angle_range=[-30, 30])
    assert dcfl.groups is None and dcfl.test_pool == "train"
    assert ((dcfl.rotations >= -30) & (dcfl.rotations < 30)).all()
    assert len(np.unique(dcfl.rotations)) == dcfl.n_clients
    base = make_partition("iid", y, y_test, _rng(), n_clients=3)
    turned = with_rotations(base, [0, 45, 90], groups=[0, 1, 2])
    assert turned.rotations.tolist() == [0, 45, 90] and base.rotations is None
    with pytest.raises(ConfigError, match="with_rotations"):
        with_rotations(base, [0, 90])


def test_test_split_reuse_policy() -> None:
    y, small_test = _synthetic(100), _synthetic(5, seed=1)
    p = make_partition("iid", y, small_test, _rng(), n_clients=10, test_size=20)
    for te in p.test:
        assert len(te) == 20 and len(np.unique(te)) == 20  # reuse only across clients
    with pytest.raises(ConfigError, match="'test_size'.*test_reuse"):
        make_partition("iid", y, small_test, _rng(), n_clients=10, test_size=20, test_reuse=False)


def test_jgl_emnist_table_construction() -> None:
    counts = np.random.default_rng(0).integers(415, 7000, size=47)
    table = jgl_emnist_table(counts)
    assert table.shape == (8, 47)
    assert ((table > 0).sum(axis=1) == 40).all()
    assert ((table == 0).sum(axis=0) >= 1).all()  # every class missing from some cluster
    assert table.sum(axis=0).tolist() == counts.tolist()  # no sample reused, none left
    for c in range(47):
        shares = table[table[:, c] > 0, c]
        assert np.ptp(shares) <= 1
    assert np.array_equal(table, jgl_emnist_table(counts))
    shuffled = jgl_emnist_table(counts, rng=_rng())
    assert ((shuffled > 0).sum(axis=1) == 40).all() and not np.array_equal(shuffled, table)
    with pytest.raises(ConfigError, match="'classes_per_cluster'"):
        jgl_emnist_table(counts, classes_per_cluster=47)


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        ("no_such", {}, "'no_such'"),
        ("iid", {"alpha": 1.0}, "'alpha'"),
        ("dirichlet", {"alpha": -1.0}, "'alpha'"),
        ("dirichlet", {"draw": "sample"}, "'draw'"),
        ("dirichlet", {"min_samples": 5}, "'min_samples'"),
        ("label_combinations", {"scenario": 4}, "'scenario'"),
        ("label_combinations", {"scenario": 1, "n_combinations": 7}, "'n_combinations'"),
        ("label_combinations", {"scenario": 2, "samples_per_label": 500}, "'samples_per_label'"),
        ("cluster_table", {"clients_per_cluster": [20, 20]}, "'clients_per_cluster'"),
        ("cluster_table", {"table": "jgl-svhn"}, "'table'"),
        ("cluster_table", {"scale": 0.5, "samples_per_client": 10}, "'samples_per_client'"),
        ("cluster_table", {"relabel": "yes"}, "'relabel'"),
        ("iid", {"test_fraction": 0.1}, "'test_fraction'"),
        ("iid", {"n_clients": 0}, "'n_clients'"),
        ("shards_powerlaw", {"min_per_class": 1000}, "'min_per_class'"),
        ("rotation", {"base": "rotation"}, "'base'"),
        ("rotation", {"angles": [0, 90], "n_groups": 3}, "'angles'"),
        ("per_client_rotation", {"angle_range": [10, 0]}, "'angle_range'"),
    ],
)
def test_bad_options_raise_config_error(name: str, options: dict, match: str) -> None:
    y, y_test = _synthetic(600), _synthetic(100, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match=match):
            make_partition(name, y, y_test, _rng(), **options)


def test_registry_and_contract() -> None:
    assert set(PARTITIONS) == {
        "iid",
        "cluster_table",
        "label_combinations",
        "dirichlet",
        "shards_powerlaw",
        "rotation",
        "per_client_rotation",
        "flwr",
    }
    with pytest.raises(ConfigError, match="test_ratio"):
        make_partition("iid", _synthetic(10), None, _rng(), n_clients=2, test_ratio=0.5)
    with pytest.raises(ConfigError, match="rotations"):
        Partition([np.arange(2)], [np.arange(1)], "test", rotations=np.zeros(2))
