"""LEAF JSON files (FEMNIST, Sent140) as federations, the natural partition, the Sent140 LSTM."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcluster.config.schema import resolve_config
from fedcluster.data.configured import build_federation_for
from fedcluster.data.federation import Federation, build_federation
from fedcluster.data.leaf import PAD_ID, UNKNOWN_ID, tokenize
from fedcluster.data.natural import natural_partition
from fedcluster.data.sources import load_dataset
from fedcluster.errors import ConfigError, DataError
from fedcluster.experiment.runner import Experiment
from fedcluster.models import build_model
from fedcluster.rng import numpy_rng


def _write(path: Path, users: dict[str, tuple[list, list]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
    }
    path.write_text(json.dumps(doc))


def _femnist_user(rng: np.random.Generator, n: int) -> tuple[list, list]:
    return rng.random((n, 784)).round(3).tolist(), rng.integers(0, 62, n).tolist()


@pytest.fixture()
def femnist_root(tmp_path: Path) -> tuple[Path, dict, dict]:
    """Three writers in two train files (LEAF's own data/ layout), sizes 5, 3, 7 / 2, 1, 3."""
    rng = np.random.default_rng(0)
    train = {"f0001_00": _femnist_user(rng, 5), "f0002_01": _femnist_user(rng, 3)}
    train2 = {"f0100_07": _femnist_user(rng, 7)}
    test = {
        u: _femnist_user(rng, n) for u, n in (("f0001_00", 2), ("f0002_01", 1), ("f0100_07", 3))
    }
    base = tmp_path / "femnist" / "data"
    _write(base / "train" / "a_train.json", train)
    _write(base / "train" / "b_train.json", train2)
    _write(base / "test" / "a_test.json", test)
    return tmp_path, {**train, **train2}, test


def _federation(name: str, root: Path, **options) -> Federation:
    dataset = load_dataset(name, root, **options)
    return build_federation(dataset, natural_partition(dataset, numpy_rng(0, "partition")))


def test_femnist_fedprox_labels_and_class_count(tmp_path: Path) -> None:
    # FedProx's my_sample.py writes labels as floats (3.0) and its models have 26 outputs.
    x = [[0.0] * 784, [1.0] * 784]
    _write(tmp_path / "femnist" / "train" / "mytrain.json", {"f_00000": (x, [3.0, 9.0])})
    _write(tmp_path / "femnist" / "test" / "mytest.json", {"f_00000": (x[:1], [3.0])})
    fed = _federation("leaf-femnist", tmp_path, n_classes=26)
    assert fed.n_classes == 26 and fed.y_train.tolist() == [3, 9] and fed.y_test.tolist() == [3]
    with pytest.raises(DataError, match="labels must be integers"):
        _write(tmp_path / "femnist" / "test" / "mytest.json", {"f_00000": (x[:1], [3.5])})
        load_dataset("leaf-femnist", tmp_path)


def test_femnist_writers_become_clients(femnist_root) -> None:
    root, train, test = femnist_root
    fed = _federation("leaf-femnist", root)
    users = list(train)  # file order: a_train.json's users, then b_train.json's
    assert fed.n_clients == 3 and fed.n_classes == 62
    assert fed.train_sizes.tolist() == [5, 3, 7] and fed.test_sizes.tolist() == [2, 1, 3]
    assert fed.input_shape == (1, 28, 28) and fed.x_train.dtype == torch.float32
    for k, user in enumerate(users):
        for split, data in (("train", train), ("test", test)):
            x_all = fed.x_train if split == "train" else fed.x_test
            y_all = fed.y_train if split == "train" else fed.y_test
            rows = fed.client_slice(k, split)
            x, y = data[user]
            assert y_all[rows].tolist() == y
            expected = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 28, 28)
            assert torch.equal(x_all[rows], expected)


def _tweet(text: str) -> list[str]:
    return ["1467810369", "Mon Apr 06 22:19:45 PDT 2009", "NO_QUERY", "someone", text]


@pytest.fixture()
def sent140_root(tmp_path: Path) -> Path:
    train = {
        "alice": ([_tweet("good good day!"), _tweet("bad day")], ["4", "0"]),
        "bob": ([_tweet("Good night"), "a plain text sample is fine too"], [1, 0]),
    }
    test = {"alice": ([_tweet("good unseenword")], [1]), "bob": ([_tweet("day")], ["0"])}
    _write(tmp_path / "sent140" / "train" / "all_data_train.json", train)
    _write(tmp_path / "sent140" / "test" / "all_data_test.json", test)
    return tmp_path


def test_sent140_token_ids_from_training_vocabulary(sent140_root: Path) -> None:
    fed = _federation("leaf-sent140", sent140_root, seq_len=4)
    assert fed.n_clients == 2 and fed.n_classes == 2
    assert fed.train_sizes.tolist() == [2, 2] and fed.test_sizes.tolist() == [1, 1]
    assert fed.x_train.dtype == torch.int64 and fed.input_shape == (4,)
    assert fed.y_train.tolist() == [1, 0, 1, 0] and fed.y_test.tolist() == [1, 0]
    # Training counts: good 3, day 2, then single tokens alphabetically: !, a, bad, fine, ...
    good, day, bang, a, bad = 2, 3, 4, 5, 6
    assert fed.x_train[0].tolist() == [good, good, day, bang]
    assert fed.x_train[1].tolist() == [bad, day, PAD_ID, PAD_ID]
    assert fed.x_train[3].tolist()[0] == a  # truncated to seq_len
    assert fed.x_test[0].tolist() == [good, UNKNOWN_ID, PAD_ID, PAD_ID]
    assert tokenize("Don't stop, ok?") == ["don't", "stop", ",", "ok", "?"]


def test_sent140_vocabulary_cap_and_file(sent140_root: Path, tmp_path: Path) -> None:
    capped = _federation("leaf-sent140", sent140_root, seq_len=3, vocab_size=4)
    assert capped.x_train[0].tolist() == [2, 2, 3] and int(capped.x_train.max()) == 3
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("day\nnight\ngood\n")
    fed = _federation("leaf-sent140", sent140_root, seq_len=3, vocab_file=str(vocab))
    assert fed.x_train[2].tolist() == [4, 3, PAD_ID]  # "good night"
    assert fed.x_train[1].tolist() == [UNKNOWN_ID, 2, PAD_ID]  # "bad day"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not a readable JSON file"),
        ('{"user_data": {}}', "no 'users' list"),
        ('{"users": ["u"], "user_data": {}}', "user 'u' is listed in 'users' but has no"),
        (
            '{"users": ["u"], "num_samples": [3], "user_data": {"u": {"x": [[0.5]], "y": [1]}}}',
            "num_samples says 3 but it has 1",
        ),
        ('{"users": ["u"], "user_data": {"u": {"x": [[0.5]], "y": [1, 2]}}}', "equal length"),
        ('{"users": ["u"], "user_data": {"u": {"x": [[0.5]], "y": [1]}}}', "784 pixel values"),
    ],
)
def test_malformed_files_name_the_file(femnist_root, content: str, message: str) -> None:
    root = femnist_root[0]
    bad = root / "femnist" / "data" / "train" / "c_bad.json"
    bad.write_text(content)
    with pytest.raises(DataError, match=message) as info:
        load_dataset("leaf-femnist", root)
    assert "c_bad.json" in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_labels_users_and_missing_files(femnist_root, sent140_root, tmp_path) -> None:
    root = femnist_root[0]
    test_dir = root / "femnist" / "data" / "test"
    _write(test_dir / "z.json", {"stranger": _femnist_user(np.random.default_rng(1), 1)})
    with pytest.raises(DataError, match="z.json: user 'stranger' has test samples but no training"):
        load_dataset("leaf-femnist", root)
    (test_dir / "z.json").unlink()
    _write(test_dir / "z.json", {"f0001_00": ([[0.0] * 784], [62])})
    with pytest.raises(DataError, match=r"user 'f0001_00' also appears in .*a_test.json"):
        load_dataset("leaf-femnist", root)
    (test_dir / "z.json").unlink()
    _write(root / "femnist" / "data" / "train" / "z.json", {"f9": ([[0.0] * 784], [62])})
    with pytest.raises(DataError, match="z.json: user 'f9': labels must be integers 0..61"):
        load_dataset("leaf-femnist", root)
    _write(sent140_root / "sent140" / "train" / "x.json", {"bob2": (["hi"], ["2"])})
    with pytest.raises(DataError, match=r"x.json: user 'bob2': a Sent140 label is 0/1"):
        load_dataset("leaf-sent140", sent140_root)
    with pytest.raises(DataError, match=r"femnist/train/\*\.json .*LEAF's scripts"):
        load_dataset("leaf-femnist", tmp_path / "empty")
    with pytest.raises(DataError, match="labels must be integers 0..25"):
        load_dataset("leaf-femnist", root, n_classes=26)
    with pytest.raises(ConfigError, match="unknown option"):
        load_dataset("leaf-femnist", root, seq_len=3)


def test_natural_partition_of_synthetic_holds_out_per_client() -> None:
    dataset = load_dataset("synthetic", seed=1, n_clients=5)
    part = natural_partition(dataset, numpy_rng(1, "partition"), test_fraction=0.1)
    offsets = np.concatenate([[0], np.cumsum(dataset.client_sizes)])
    assert part.test_pool == "train" and part.n_clients == 5
    for k in range(5):
        own = np.arange(offsets[k], offsets[k + 1])
        both = np.concatenate([part.train[k], part.test[k]])
        assert np.array_equal(np.sort(both), own)  # a client's samples stay its own
        assert len(part.test[k]) == max(1, int(np.rint(0.1 * len(own))))  # FedProx's 10 %
    with pytest.raises(ConfigError, match="needs a federated dataset"):
        natural_partition(load_dataset("digits"), numpy_rng(0, "partition"))


def test_lstm_round_of_fedavg_through_the_runner(sent140_root: Path, tmp_path: Path) -> None:
    sets = [
        "data.dataset=leaf-sent140",
        f"data.data_dir={sent140_root}",
        "data.options={seq_len: 5, vocab_size: 20}",
        "data.partition={name: natural}",
        "model.name=lstm",
        "model.options={vocab_size: 20, embedding_dim: 8, hidden: 6, fc: 4}",
        "rounds=1",
        "train={lr: 0.1, batch_size: 2, epochs: 1}",
        "algorithms=[{name: fedavg}]",
    ]
    config = resolve_config(None, "quickstart", sets)
    fed = build_federation_for(config, 0)
    assert fed.x_train.dtype == torch.int64
    Experiment(config).run(tmp_path / "run", progress=False)
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and 0.0 <= float(rows[0]["accuracy"]) <= 1.0
    assert np.isfinite(float(rows[0]["loss"])) and np.isfinite(float(rows[0]["test_loss"]))


def test_lstm_reads_the_last_real_token_and_checks_ids() -> None:
    torch.manual_seed(0)
    model = build_model("lstm", (6,), 2, vocab_size=10, embedding_dim=4, hidden=3, fc=2)
    x = torch.tensor([[3, 4, 5, 0, 0, 0]])
    # Padding after the text does not change the output: it is read at the last real token.
    assert torch.allclose(model(x), model(x[:, :3]))
    assert not torch.allclose(model(x), model(torch.tensor([[3, 4, 5, 6, 0, 0]])))
    with pytest.raises(ConfigError, match="token id 12 >= vocab_size 10"):
        model(torch.tensor([[12, 0, 0, 0, 0, 0]]))
    with pytest.raises(ConfigError, match="token-id inputs"):
        build_model("lstm", (1, 28, 28), 2)


@pytest.mark.parametrize("preset", ["fedgroup-femnist-mclr", "fedgroup-femnist-mlp"])
def test_femnist_presets_need_the_users_files(preset: str, tmp_path: Path) -> None:
    config = resolve_config(None, preset, [f"data.data_dir={tmp_path}"])
    assert config.model.name in ("mclr", "mlp") and config.data.partition["name"] == "natural"
    with pytest.raises(DataError, match=rf"{tmp_path}: missing femnist/train/\*\.json"):
        build_federation_for(config, 0)


def test_packing_keeps_token_ids_integer_and_images_float() -> None:
    y = torch.tensor([0, 1])
    ids = [(torch.tensor([[3, 4], [5, 0]], dtype=torch.int32), y)]
    fed = Federation.from_clients(ids, ids, 2)
    assert fed.x_train.dtype == torch.int64 and fed.x_train.tolist() == [[3, 4], [5, 0]]
    pixels = [(torch.tensor([[0, 255], [128, 7]], dtype=torch.uint8), y)]
    fed = Federation.from_clients(pixels, pixels, 2)
    assert fed.x_train.dtype == torch.float32 and fed.x_train[0, 1].item() == 255.0
