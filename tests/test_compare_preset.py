"""The comparison of the recent clustered methods (preset ``compare-cfl``,
``benchmarks/reproduction/compare_methods.py``): the preset loads with the eight methods, and each
setting of the benchmark builds the federation its docstring describes."""

from __future__ import annotations

import numpy as np

from benchmarks.reproduction.compare_methods import _SKEW_TABLE, PRESET, SETTINGS
from fedcluster.config.schema import resolve_config
from fedcluster.data.configured import build_federation_for


def test_compare_preset_loads_the_new_methods_beside_their_baselines():
    config = resolve_config(None, PRESET)
    names = [a.name for a in config.algorithms]
    assert names == ["fedavg", "ifca", "fedgroup", "dcfl", "pacfl", "wecfl", "fedsoft", "fedem"]
    assert config.seeds == [0, 1, 2]
    by_name = {a.name: a.params for a in config.algorithms}
    assert by_name["fedem"] == {"n_components": 4} and by_name["ifca"] == {"n_clusters": 4}
    fashion = resolve_config(None, PRESET, SETTINGS["rotated-fmnist"]).data
    assert fashion.dataset == "fashion-mnist"  # the rotation partition of the preset, from
    assert fashion.partition["name"] == config.data.partition["name"]  # its own test split


def _federation(setting: str):
    return build_federation_for(resolve_config(None, PRESET, SETTINGS[setting]), 0)


def test_rotation_setting_is_four_groups_of_four_clients():
    fed = _federation("rotated-mnist")
    assert fed.n_clients == 16 and np.bincount(fed.groups).tolist() == [4, 4, 4, 4]
    assert fed.train_sizes.tolist() == [100] * 16
    for g in range(4):  # one angle per group, the four groups at 0/90/180/270 degrees
        assert len(set(fed.rotations[fed.groups == g].tolist())) == 1
    assert sorted({float(fed.rotations[fed.groups == g][0]) for g in range(4)}) == [
        0.0,
        90.0,
        180.0,
        270.0,
    ]


def test_label_skew_setting_gives_each_group_its_five_digits():
    fed = _federation("label-skew")
    assert fed.n_clients == 16 and np.bincount(fed.groups).tolist() == [4, 4, 4, 4]
    for c in range(fed.n_clients):
        held = np.flatnonzero(np.asarray(_SKEW_TABLE[fed.groups[c]]))
        for split in ("train", "test"):
            y = (fed.y_train if split == "train" else fed.y_test)[fed.client_slice(c, split)]
            assert set(y.tolist()) == set(held.tolist())  # its 5 digits, every one of them
        assert len(fed.y_train[fed.client_slice(c)]) == 100
