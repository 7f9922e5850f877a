"""Data sources: the real datasets in shared/data, and small files written here."""

from __future__ import annotations

import gzip
import io
import os
import pickle
import struct
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcluster.data import cifar
from fedcluster.data.sources import (
    Dataset,
    list_datasets,
    load_dataset,
    resolve_data_dir,
    user_cache_dir,
)
from fedcluster.data.synthetic import synthetic_federation
from fedcluster.errors import ConfigError, DataError

GetDataset = Callable[[str], Dataset]


def _counts(y: torch.Tensor, n: int) -> list[int]:
    return torch.bincount(y, minlength=n).tolist()


# --------------------------------------------------------------------------- data root


def test_resolve_data_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FEDCLUSTER_DATA", str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_data_dir(tmp_path / "arg") == tmp_path / "arg"
    assert resolve_data_dir(str(tmp_path / "arg")) == tmp_path / "arg"
    assert resolve_data_dir(None) == tmp_path / "env"
    monkeypatch.delenv("FEDCLUSTER_DATA")
    assert resolve_data_dir(None) == tmp_path / "xdg" / "fedcluster"
    assert user_cache_dir() == tmp_path / "xdg" / "fedcluster"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert resolve_data_dir(None) == Path.home() / ".cache" / "fedcluster"


def test_list_datasets() -> None:
    assert list_datasets() == [
        "mnist",
        "fashion-mnist",
        "emnist-bymerge",
        "emnist-byclass",
        "cifar10",
        "digits",
        "mnist5k",
        "synthetic",
        "leaf-femnist",
        "leaf-sent140",
    ]


def test_unknown_name_and_option() -> None:
    with pytest.raises(ConfigError, match="unknown dataset 'svhn'"):
        load_dataset("svhn")
    with pytest.raises(ConfigError, match="colour"):
        load_dataset("digits", colour=True)
    with pytest.raises(ConfigError, match="gamma"):
        load_dataset("synthetic", gamma=1.0)


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist", "emnist-bymerge", "cifar10"])
def test_missing_dataset_says_where_and_how(name: str, tmp_path: Path) -> None:
    with pytest.raises(DataError) as info:
        load_dataset(name, tmp_path)
    message = str(info.value)
    assert str(tmp_path) in message
    assert "--download" in message and "FEDCLUSTER_DATA" in message


# --------------------------------------------------------------------------- real data


def test_mnist(shared_dataset: GetDataset) -> None:
    ds = shared_dataset("mnist")
    assert ds.classes == tuple("0123456789")
    assert ds.train.x.shape == (60000, 1, 28, 28) and ds.train.x.dtype == torch.float32
    assert ds.test is not None and ds.test.x.shape == (10000, 1, 28, 28)
    assert ds.train.y.dtype == torch.int64
    assert float(ds.train.x.min()) == 0.0 and float(ds.train.x.max()) == 1.0
    assert _counts(ds.train.y, 10) == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert _counts(ds.test.y, 10) == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def test_fashion_mnist(shared_dataset: GetDataset) -> None:
    ds = shared_dataset("fashion-mnist")
    assert ds.classes[0] == "T-shirt/top" and ds.classes[9] == "Ankle boot"
    assert ds.train.x.shape == (60000, 1, 28, 28)
    assert ds.test is not None and ds.test.x.shape == (10000, 1, 28, 28)
    assert _counts(ds.train.y, 10) == [6000] * 10
    assert _counts(ds.test.y, 10) == [1000] * 10


def _spread(profile: torch.Tensor) -> float:
    """Standard deviation of the position, weighting positions by ``profile``."""
    w = profile / profile.sum()
    pos = torch.arange(len(w), dtype=w.dtype)
    mean = (w * pos).sum()
    return float((w * (pos - mean) ** 2).sum().sqrt())


@pytest.mark.parametrize(("name", "n_classes"), [("emnist-bymerge", 47), ("emnist-byclass", 62)])
def test_emnist(shared_dataset: GetDataset, name: str, n_classes: int) -> None:
    ds = shared_dataset(name)
    assert len(ds.classes) == n_classes
    assert ds.classes[:36] == tuple("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    assert ds.test is None  # only the test split is available: returned as the single pool
    assert ds.train.x.shape == (116323, 1, 28, 28)
    assert int(ds.train.y.max()) == n_classes - 1
    if n_classes == 47:
        assert min(_counts(ds.train.y, n_classes)) >= 415
    # Upright: the mean '1' (and 'I') is a vertical stroke, so its mass spreads
    # over many rows and few columns; stored transposed, it is the other way round.
    for name in "1I":
        img = ds.train.x[ds.train.y == ds.classes.index(name), 0].mean(0)
        assert _spread(img.sum(1)) > 1.5 * _spread(img.sum(0)), name  # ~2; transposed ~0.5


def test_emnist_digits_look_like_mnist(shared_dataset: GetDataset) -> None:
    mnist = shared_dataset("mnist")
    emnist = shared_dataset("emnist-bymerge")
    margins = []
    for d in range(10):
        ref = mnist.train.x[mnist.train.y == d, 0].mean(0).flatten()
        img = emnist.train.x[emnist.train.y == d, 0].mean(0)
        upright = torch.corrcoef(torch.stack([ref, img.flatten()]))[0, 1]
        transposed = torch.corrcoef(torch.stack([ref, img.T.flatten()]))[0, 1]
        margins.append(float(upright - transposed))
    # Every mean digit matches MNIST's better as loaded than transposed ('0' barely).
    assert min(margins) > 0 and np.mean(margins) > 0.2, margins


def test_cifar10_from_zip(shared_dataset: GetDataset, shared_data_dir: Path) -> None:
    source = cifar.find_source(shared_data_dir / "cifar10")
    if source is None or source.name != cifar.IMAGES_ZIP:
        pytest.skip(f"shared CIFAR-10 is not the JPEG zip ({source})")
    ds = shared_dataset("cifar10")
    assert ds.classes == (
        "airplane",
        "automobile",
        "bird",
        "cat",
        "deer",
        "dog",
        "frog",
        "horse",
        "ship",
        "truck",
    )
    assert ds.train.x.shape == (50000, 3, 32, 32) and ds.train.x.dtype == torch.float32
    assert ds.test is not None and ds.test.x.shape == (10000, 3, 32, 32)
    assert _counts(ds.train.y, 10) == [5000] * 10
    assert _counts(ds.test.y, 10) == [1000] * 10
    # normalised per channel by default: the channel means of the (JPEG) training images
    # are 0.491, 0.482, 0.447 in [0, 1], about 0 after (x - MEAN) / STD
    means = ds.train.x.mean(dim=(0, 2, 3))
    assert torch.allclose(means, torch.zeros(3), atol=0.01), means
    # The zip's files are numbered per class; loaded in tree_order, IFCA's 20 test
    # clients (the test split in order) each hold every class, as with the official order.
    for chunk in torch.tensor_split(ds.test.y, 20):
        assert _counts(chunk, 10).count(0) == 0


def test_digits() -> None:
    ds = load_dataset("digits")
    assert ds.train.x.shape == (1797, 1, 8, 8) and ds.train.x.dtype == torch.float32
    assert ds.test is None and ds.classes == tuple("0123456789")
    assert float(ds.train.x.max()) == 1.0 and float(ds.train.x.min()) == 0.0
    assert ds.train.y.dtype == torch.int64 and int(ds.train.y.max()) == 9


def test_mnist5k() -> None:
    ds = load_dataset("mnist5k")
    assert ds.train.x.shape == (5000, 1, 28, 28) and ds.test is None
    assert _counts(ds.train.y, 10) == [500] * 10
    assert float(ds.train.x.max()) == 1.0 and float(ds.train.x.min()) == 0.0
    # Upright like MNIST: the mean '1' is a vertical stroke.
    one = ds.train.x[ds.train.y == 1, 0].mean(0)
    assert _spread(one.sum(1)) > 1.5 * _spread(one.sum(0))


# --------------------------------------------------------------------------- synthetic


def test_synthetic_deterministic_and_federated() -> None:
    a = load_dataset("synthetic", seed=3, n_clients=20, alpha=1.0, beta=1.0)
    b = load_dataset("synthetic", seed=3, n_clients=20, alpha=1.0, beta=1.0)
    c = load_dataset("synthetic", seed=4, n_clients=20, alpha=1.0, beta=1.0)
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.train.y, b.train.y)
    assert not torch.equal(a.train.x[:50], c.train.x[:50])
    assert a.train.x.shape[1] == 60 and a.train.x.dtype == torch.float32
    assert a.test is None and len(a.classes) == 10
    assert a.client_sizes is not None and len(a.client_sizes) == 20
    assert int(a.client_sizes.sum()) == len(a.train.y) and a.client_sizes.min() >= 50
    clients = synthetic_federation(20, 1.0, 1.0, seed=3)
    offsets = np.concatenate([[0], np.cumsum(a.client_sizes)])
    for k, (x, y) in enumerate(clients):
        assert np.array_equal(a.train.x[offsets[k] : offsets[k + 1]].numpy(), x)
        assert np.array_equal(a.train.y[offsets[k] : offsets[k + 1]].numpy(), y)


def test_synthetic_clients_differ() -> None:
    clients = synthetic_federation(30, 1.0, 1.0, seed=0)
    means = np.stack([x.mean(0) for x, _ in clients])
    # Each client's inputs are centred on its own v_k ~ N(B_k, 1): far apart.
    dist = np.linalg.norm(means[:, None] - means[None], axis=2)
    assert np.median(dist[np.triu_indices(30, 1)]) > 5
    hist = np.stack([np.bincount(y, minlength=10) / len(y) for _, y in clients])
    tv = 0.5 * np.abs(hist[:, None] - hist[None]).sum(axis=2)
    assert np.median(tv[np.triu_indices(30, 1)]) > 0.3
    # alpha = beta = 0 with iid: every client draws from the same distribution.
    iid = synthetic_federation(30, 0.0, 0.0, seed=0, iid=True)
    iid_means = np.stack([x.mean(0) for x, _ in iid])
    assert np.abs(iid_means).max() < 1.0


def test_synthetic_client_data_independent_of_client_count() -> None:
    few = synthetic_federation(3, 0.5, 0.5, seed=1)
    many = synthetic_federation(6, 0.5, 0.5, seed=1)
    for (x1, y1), (x2, y2) in zip(few, many[:3], strict=True):
        assert np.array_equal(x1, x2) and np.array_equal(y1, y2)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n_clients": 0}, "n_clients"),
        ({"n_clients": 2.5}, "n_clients"),
        ({"alpha": -1.0}, "alpha"),
        ({"beta": "1"}, "beta"),
        ({"n_classes": 1}, "n_classes"),
        ({"iid": 1}, "iid"),
    ],
)
def test_synthetic_bad_options(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        load_dataset("synthetic", **kwargs)


# --------------------------------------------------------------------------- IDX files


def _idx(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def _fake_mnist(root: Path, folder: str = "mnist", suffix: str = ".gz") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (20, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": np.arange(20, dtype=np.uint8) % 10,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (10, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": np.arange(10, dtype=np.uint8)[::-1].copy(),
    }
    for name, array in arrays.items():
        _write(root / folder / f"{name}{suffix}", _idx(array))
    return arrays


@pytest.mark.parametrize("suffix", [".gz", ""])
def test_small_idx_dataset_roundtrip(tmp_path: Path, suffix: str) -> None:
    arrays = _fake_mnist(tmp_path, "fashion-mnist", suffix)
    ds = load_dataset("fashion-mnist", tmp_path)
    assert ds.test is not None
    assert np.array_equal(
        (ds.train.x[:, 0] * 255).round().numpy().astype(np.uint8),
        arrays["train-images-idx3-ubyte"],
    )
    assert ds.train.y.tolist() == arrays["train-labels-idx1-ubyte"].tolist()
    assert ds.test.y.tolist() == arrays["t10k-labels-idx1-ubyte"].tolist()


def test_gzip_detected_by_content(tmp_path: Path) -> None:
    arrays = _fake_mnist(tmp_path)
    folder = tmp_path / "mnist"
    (folder / "t10k-labels-idx1-ubyte.gz").rename(folder / "t10k-labels-idx1-ubyte")
    ds = load_dataset("mnist", tmp_path)
    assert ds.test is not None
    assert ds.test.y.tolist() == arrays["t10k-labels-idx1-ubyte"].tolist()


def _corrupt_truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-200])


def _corrupt_magic(path: Path) -> None:
    data = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(b"\x08\x03\x00\x00" + data[4:]))


def _corrupt_gzip(path: Path) -> None:
    path.write_bytes(b"this is not gzip data at all")


def _corrupt_count(path: Path) -> None:
    data = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(data[:4] + struct.pack(">I", 60000) + data[8:]))


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_corrupt_truncated, "not a valid gzip file or truncated"),
        (_corrupt_magic, "wrong magic number"),
        (_corrupt_gzip, "not a valid gzip file"),
        (_corrupt_count, "header says 60000 images of 28x28"),
    ],
)
def test_corrupted_image_file(
    tmp_path: Path, corrupt: Callable[[Path], None], message: str
) -> None:
    _fake_mnist(tmp_path)
    path = tmp_path / "mnist" / "train-images-idx3-ubyte.gz"
    corrupt(path)
    with pytest.raises(DataError, match=message) as info:
        load_dataset("mnist", tmp_path)
    assert str(path) in str(info.value)


def test_truncated_raw_file_reports_sizes(tmp_path: Path) -> None:
    _fake_mnist(tmp_path, suffix="")
    path = tmp_path / "mnist" / "t10k-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(DataError) as info:
        load_dataset("mnist", tmp_path)
    assert str(info.value) == (
        f"{path}: header says 10 images of 28x28 (7840 bytes) but the file holds 984 bytes of data"
    )


def test_label_count_mismatch(tmp_path: Path) -> None:
    _fake_mnist(tmp_path)
    path = _write(tmp_path / "mnist" / "train-labels-idx1-ubyte.gz", _idx(np.zeros(19, np.uint8)))
    with pytest.raises(DataError, match="19 labels but train-images-idx3-ubyte.gz holds 20") as e:
        load_dataset("mnist", tmp_path)
    assert str(path) in str(e.value)


def test_label_out_of_range(tmp_path: Path) -> None:
    _fake_mnist(tmp_path)
    _write(tmp_path / "mnist" / "t10k-labels-idx1-ubyte.gz", _idx(np.full(10, 12, np.uint8)))
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.gz: labels range 12..12"):
        load_dataset("mnist", tmp_path)


def test_wrong_dimensions(tmp_path: Path) -> None:
    _fake_mnist(tmp_path)
    _write(tmp_path / "mnist" / "train-labels-idx1-ubyte.gz", _idx(np.zeros((20, 1), np.uint8)))
    with pytest.raises(DataError, match="says 2 dimension"):
        load_dataset("mnist", tmp_path)


def test_missing_single_file(tmp_path: Path) -> None:
    _fake_mnist(tmp_path)
    (tmp_path / "mnist" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="missing mnist/t10k-labels-idx1-ubyte") as info:
        load_dataset("mnist", tmp_path)
    assert "train-labels" not in str(info.value)


# --------------------------------------------------------------------------- EMNIST files


def _fake_emnist(root: Path, split: str, parts: tuple[str, ...]) -> np.ndarray:
    """Files for ``split``; every image is a vertical bar, stored transposed."""
    upright = np.zeros((28, 28), np.uint8)
    upright[4:24, 13:15] = 255
    for part in parts:
        images = np.stack([upright.T] * 6)
        labels = np.array([0, 1, 2, 0, 1, 2], np.uint8)
        _write(root / "emnist" / f"emnist-{split}-{part}-images-idx3-ubyte.gz", _idx(images))
        _write(root / "emnist" / f"emnist-{split}-{part}-labels-idx1-ubyte.gz", _idx(labels))
    (root / "emnist" / f"emnist-{split}-mapping.txt").write_text("0 48\n1 65\n2 97\n")
    return upright


def test_emnist_files_test_only_and_transposed(tmp_path: Path) -> None:
    upright = _fake_emnist(tmp_path, "bymerge", ("test",))
    ds = load_dataset("emnist-bymerge", tmp_path)
    assert ds.classes == ("0", "A", "a") and ds.test is None
    assert ds.train.x.shape == (6, 1, 28, 28) and ds.train.x.is_contiguous()
    assert np.array_equal((ds.train.x[0, 0] * 255).numpy().astype(np.uint8), upright)


def test_emnist_files_train_and_test(tmp_path: Path) -> None:
    _fake_emnist(tmp_path, "byclass", ("train", "test"))
    ds = load_dataset("emnist-byclass", tmp_path)
    assert ds.test is not None and len(ds.train.y) == len(ds.test.y) == 6


def test_emnist_bad_mapping(tmp_path: Path) -> None:
    _fake_emnist(tmp_path, "bymerge", ("test",))
    path = tmp_path / "emnist" / "emnist-bymerge-mapping.txt"
    path.write_text("0 48\n1 sixty-five\n")
    with pytest.raises(DataError, match="line 2"):
        load_dataset("emnist-bymerge", tmp_path)
    path.write_text("0 48\n2 65\n")
    with pytest.raises(DataError, match=r"not 0\.\.n-1"):
        load_dataset("emnist-bymerge", tmp_path)


def test_emnist_half_a_train_pair(tmp_path: Path) -> None:
    _fake_emnist(tmp_path, "bymerge", ("test", "train"))
    (tmp_path / "emnist" / "emnist-bymerge-train-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="emnist-bymerge-train-labels-idx1-ubyte.*not found"):
        load_dataset("emnist-bymerge", tmp_path)


# --------------------------------------------------------------------------- CIFAR files

_CLASSES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)


def _fake_cifar_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    train_x = rng.integers(0, 256, (10, 3, 32, 32), dtype=np.uint8)
    test_x = rng.integers(0, 256, (4, 3, 32, 32), dtype=np.uint8)
    # Labels sorted: an image-folder tree of them, sorted by class, is in this order too.
    return train_x, np.arange(10), test_x, np.array([1, 1, 3, 4])


def _write_batches(folder: Path) -> None:
    train_x, train_y, test_x, test_y = _fake_cifar_arrays()
    folder.mkdir(parents=True)

    def dump(name: str, obj: dict) -> None:
        (folder / name).write_bytes(pickle.dumps(obj, protocol=2))

    dump("batches.meta", {b"label_names": [c.encode() for c in _CLASSES]})
    for i in range(5):
        rows = slice(2 * i, 2 * i + 2)
        dump(
            f"data_batch_{i + 1}",
            {b"data": train_x[rows].reshape(2, -1), b"labels": train_y[rows].tolist()},
        )
    dump("test_batch", {b"data": test_x.reshape(4, -1), b"labels": test_y.tolist()})


def _pixels(x: torch.Tensor) -> np.ndarray:
    """uint8 pixels back from images normalised per channel (the CIFAR-10 default)."""
    std = torch.tensor(cifar.STD).view(1, 3, 1, 1)
    mean = torch.tensor(cifar.MEAN).view(1, 3, 1, 1)
    return ((x * std + mean) * 255).round().numpy().astype(np.uint8)


def _check_fake_cifar(ds: Dataset, tree: bool = False) -> None:
    """``ds`` holds the fake arrays: in their order from the official forms, in
    :func:`cifar.tree_order` from an image tree (``tree``)."""
    train_x, train_y, test_x, test_y = _fake_cifar_arrays()
    if tree:
        train, test = cifar.tree_order(len(train_y)), cifar.tree_order(len(test_y))
        train_x, train_y, test_x, test_y = (
            train_x[train],
            train_y[train],
            test_x[test],
            test_y[test],
        )
    assert ds.classes == _CLASSES and ds.test is not None
    assert np.array_equal(_pixels(ds.train.x), train_x)
    assert ds.train.y.tolist() == train_y.tolist()
    assert np.array_equal(_pixels(ds.test.x), test_x)
    assert ds.test.y.tolist() == test_y.tolist()


def test_cifar_pickle_batches_and_tarball(tmp_path: Path) -> None:
    _write_batches(tmp_path / "extracted" / "cifar10" / cifar.BATCHES_DIR)
    _check_fake_cifar(load_dataset("cifar10", tmp_path / "extracted"))
    tar_root = tmp_path / "tarball" / "cifar10"
    tar_root.mkdir(parents=True)
    with tarfile.open(tar_root / cifar.TARBALL, "w:gz") as tar:
        tar.add(tmp_path / "extracted" / "cifar10" / cifar.BATCHES_DIR, cifar.BATCHES_DIR)
    _check_fake_cifar(load_dataset("cifar10", tmp_path / "tarball"))


def test_cifar_pickle_refuses_code(tmp_path: Path) -> None:
    folder = tmp_path / "cifar10" / cifar.BATCHES_DIR
    _write_batches(folder)
    (folder / "data_batch_3").write_bytes(pickle.dumps({b"data": os.getcwd}))
    with pytest.raises(DataError, match="data_batch_3: not a CIFAR-10 pickle batch"):
        load_dataset("cifar10", tmp_path)


def test_cifar_truncated_tarball(tmp_path: Path) -> None:
    _write_batches(tmp_path / "src")
    tarball = tmp_path / "root" / "cifar10" / cifar.TARBALL
    tarball.parent.mkdir(parents=True)
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(tmp_path / "src", cifar.BATCHES_DIR)
    tarball.write_bytes(tarball.read_bytes()[:-100])
    with pytest.raises(DataError, match="not a valid tar.gz archive or truncated") as info:
        load_dataset("cifar10", tmp_path / "root")
    assert str(tarball) in str(info.value)


def _png(pixels_chw: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels_chw.transpose(1, 2, 0)).save(buf, format="PNG")
    return buf.getvalue()


def _tree_files() -> dict[str, bytes]:
    """Relative path -> content of an image-folder tree (PNG: lossless) of the fake data."""
    train_x, train_y, test_x, test_y = _fake_cifar_arrays()
    files = {}
    for split, xs, ys in (("train", train_x, train_y), ("test", test_x, test_y)):
        for k, (x, y) in enumerate(zip(xs, ys, strict=True)):
            files[f"cifar10/{split}/{_CLASSES[y]}/{k:04d}.png"] = _png(x)
    return files


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_cifar_image_tree_and_zip_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cache = tmp_path / "cache" / "fedcluster" / "decoded"
    files = _tree_files()
    tree_root = tmp_path / "tree"
    for rel, content in files.items():
        _write(tree_root / "cifar10" / rel, content)
    zip_root = tmp_path / "zipped"
    (zip_root / "cifar10").mkdir(parents=True)
    with zipfile.ZipFile(zip_root / "cifar10" / cifar.IMAGES_ZIP, "w") as zf:
        for rel, content in files.items():
            zf.writestr(rel, content)
    for root in (tree_root, zip_root):
        before = _listing(root)
        first = load_dataset("cifar10", root)
        n_cached = len(list(cache.glob("*.npz")))
        again = load_dataset("cifar10", root)
        assert len(list(cache.glob("*.npz"))) == n_cached
        _check_fake_cifar(first, tree=True)
        _check_fake_cifar(again, tree=True)
        assert _listing(root) == before  # nothing written into the data root
    assert len(list(cache.glob("*.npz"))) == 2
    # A garbled cache entry is rebuilt, a changed source gets a new entry.
    for entry in cache.glob("*.npz"):
        entry.write_bytes(b"garbage")
    _check_fake_cifar(load_dataset("cifar10", zip_root), tree=True)
    os.utime(zip_root / "cifar10" / cifar.IMAGES_ZIP, ns=(0, 0))
    _check_fake_cifar(load_dataset("cifar10", zip_root), tree=True)
    assert len(list(cache.glob("*.npz"))) == 3
    assert not list(cache.glob("*.tmp"))


def test_cifar_image_tree_comes_in_a_fixed_mixed_order(tmp_path: Path) -> None:
    """An image tree's files are numbered per class (as in shared/data's zip): each
    loaded split is the class-sorted one reordered by the fixed tree_order, so cutting
    the test split in order (IFCA's test clients) gives chunks of several classes, and
    two loads (decoded, then from the cache) agree."""
    rng = np.random.default_rng(7)
    per_class = {"train": 2, "test": 6}
    # class-sorted arrays, as the files are numbered: class c, file k
    images = {
        s: rng.integers(0, 256, (10 * n, 3, 32, 32), dtype=np.uint8) for s, n in per_class.items()
    }
    labels = {s: np.repeat(np.arange(10), n) for s, n in per_class.items()}
    for split, n in per_class.items():
        for row, (x, y) in enumerate(zip(images[split], labels[split], strict=True)):
            _write(tmp_path / "cifar10" / split / _CLASSES[y] / f"{row % n:04d}.png", _png(x))
    cache = tmp_path / "cache"
    first = cifar.load_cifar10(tmp_path, cache)
    again = cifar.load_cifar10(tmp_path, cache)
    assert len(list(cache.glob("*.npz"))) == 1
    for split in per_class:
        x, y = getattr(first, f"{split}_x"), getattr(first, f"{split}_y")
        assert np.array_equal(x, getattr(again, f"{split}_x"))
        assert np.array_equal(y, getattr(again, f"{split}_y"))
        # every loaded image is one written, with its label, each written image once
        written = {img.tobytes(): row for row, img in enumerate(images[split])}
        rows = np.array([written[img.tobytes()] for img in x])
        assert sorted(rows.tolist()) == list(range(len(rows)))
        assert np.array_equal(y, labels[split][rows])
        assert np.array_equal(rows, cifar.tree_order(len(rows)))
    # class-sorted, the first of 5 test chunks (12 images) would hold 2 classes
    first_chunk = np.array_split(first.test_y, 5)[0]
    assert len(set(first_chunk.tolist())) >= 6, first_chunk


def test_cifar_corrupted_zip_member(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    files = _tree_files()
    bad = "cifar10/train/bird/0002.png"
    files[bad] = files[bad][:40]
    path = tmp_path / "cifar10" / cifar.IMAGES_ZIP
    path.parent.mkdir()
    with zipfile.ZipFile(path, "w") as zf:
        for rel, content in files.items():
            zf.writestr(rel, content)
    with pytest.raises(DataError, match=f"{bad}: cannot decode the image"):
        load_dataset("cifar10", tmp_path)
    path.write_bytes(b"PK not really a zip")
    with pytest.raises(DataError, match="not a valid zip archive") as info:
        load_dataset("cifar10", tmp_path)
    assert str(path) in str(info.value)
