"""CIFAR-10 from any of its usual on-disk forms.

Accepted, in the order they are looked for under the dataset folder:

1. ``cifar-10-batches-py/`` -- the official Python pickle batches, extracted;
2. ``cifar-10-python.tar.gz`` -- the official archive, read without extracting;
3. an image-folder tree ``train/<class>/*.jpg`` and ``test/<class>/*.jpg``, either
   directly in the folder or in ``cifar10/`` below it;
4. ``cifar10-images.zip`` -- a zip of such a tree (as in ``shared/data``).

Class names of an image-folder tree are its sorted folder names, which for
CIFAR-10 is the official label order. Decoding 60,000 JPEGs takes seconds, so
the decoded arrays of forms 3 and 4 are cached as ``.npz`` in a cache folder,
keyed by the source's path, size and modification time; the data folder
itself is never written to.

Sample order: forms 1 and 2 keep the official order (``data_batch_1`` .. ``_5``,
then ``test_batch``), whose classes are mixed. An image tree has no such order
(its files are numbered per class), and read class by class it would give
partitions that cut a split in order (IFCA's test clients: the test split in
chunks) one class per chunk. So forms 3 and 4 are put in a fixed mixed order:
each split, sorted by (class, file name), is reordered by :func:`tree_order`, a
permutation that depends on the split's size only (not on the run's seed). It is
applied after the cache, which holds the sorted arrays.

:data:`MEAN` and :data:`STD` are the per-channel statistics of the 50,000
official training images in [0, 1], the constants of the usual
``transforms.Normalize`` for CIFAR-10; the loader's ``normalize: channel``
(:mod:`fedcluster.data.sources`) uses them.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import tarfile
import tempfile
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedcluster.errors import DataError

BATCHES_DIR = "cifar-10-batches-py"
TARBALL = "cifar-10-python.tar.gz"
IMAGES_ZIP = "cifar10-images.zip"
_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
_TEST_BATCH = "test_batch"
_META = "batches.meta"
_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
_CACHE_VERSION = 1
TREE_ORDER_SEED = 2009
"""Seed of :func:`tree_order` (the year of the CIFAR-10 report); never the run's seed."""
MEAN = (0.4914, 0.4822, 0.4465)
"""Per-channel (R, G, B) mean of the official training images in [0, 1]."""
STD = (0.2470, 0.2435, 0.2616)
"""Per-channel population std of the official training images in [0, 1] (the decoded
JPEG zip of ``shared/data`` gives 0.2452, 0.2428, 0.2606: JPEG smooths a little)."""


@dataclass(frozen=True)
class CifarArrays:
    """Decoded CIFAR-10: images uint8 ``[N, 3, 32, 32]``, labels int64 ``[N]``."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray | None
    test_y: np.ndarray | None
    classes: tuple[str, ...]


def find_source(folder: Path) -> Path | None:
    """The first CIFAR-10 source found in ``folder`` (see the module docstring), or None."""
    if (folder / BATCHES_DIR).is_dir():
        return folder / BATCHES_DIR
    if (folder / TARBALL).is_file():
        return folder / TARBALL
    for root in (folder, folder / "cifar10"):
        if (root / "train").is_dir():
            return root
    if (folder / IMAGES_ZIP).is_file():
        return folder / IMAGES_ZIP
    return None


def tree_order(n: int) -> np.ndarray:
    """The order of a split of ``n`` images from an image tree: row k of the loaded
    split is row ``tree_order(n)[k]`` of the split sorted by (class, file name).

    ``np.random.default_rng(TREE_ORDER_SEED).permutation(n)``: fixed, seed-independent.
    """
    return np.random.default_rng(TREE_ORDER_SEED).permutation(n)


def _mixed(arrays: CifarArrays) -> CifarArrays:
    """``arrays`` (each split sorted by class) with each split in :func:`tree_order`."""
    train = tree_order(len(arrays.train_y))
    test_x = test_y = None
    if arrays.test_x is not None and arrays.test_y is not None:
        test = tree_order(len(arrays.test_y))
        test_x, test_y = arrays.test_x[test], arrays.test_y[test]
    return CifarArrays(arrays.train_x[train], arrays.train_y[train], test_x, test_y, arrays.classes)


def load_cifar10(folder: Path, cache_dir: Path | None) -> CifarArrays:
    """Load CIFAR-10 from the first source found in ``folder`` (see :func:`find_source`).

    The official forms keep the official order; an image tree or zip comes in
    :func:`tree_order` (see the module docstring). ``cache_dir`` holds decoded JPEG
    sources (None: no caching).

    Raises:
        DataError: no source found, or a file is truncated or corrupted; the
            message names it.
    """
    source = find_source(folder)
    if source is None:
        raise DataError(f"{folder}: no CIFAR-10 files found")
    if source.name == BATCHES_DIR:
        return _from_batches(lambda name: _read_file(source / name), str(source))
    if source.name == TARBALL:
        return _from_tarball(source)
    if source.is_dir():
        files = sorted(
            p
            for split in ("train", "test")
            for p in (source / split).rglob("*")
            if p.suffix.lower() in _IMAGE_SUFFIXES
        )
        rel = [p.relative_to(source).as_posix() for p in files]
        stats = [p.stat() for p in files]
        fingerprint = "\n".join(
            f"{r}|{s.st_size}|{s.st_mtime_ns}" for r, s in zip(rel, stats, strict=True)
        )
        entries = dict(zip(rel, files, strict=True))
        return _mixed(
            _cached(
                source,
                fingerprint,
                cache_dir,
                lambda: _from_image_tree(str(source), rel, lambda r: entries[r].read_bytes()),
            )
        )
    stat = source.stat()
    return _mixed(
        _cached(source, f"{stat.st_size}|{stat.st_mtime_ns}", cache_dir, lambda: _from_zip(source))
    )


def _read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read the file ({exc.strerror or exc})") from exc


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, bytes and NumPy arrays only: no arbitrary code."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # bytes in protocol-2 pickles written by Python 3
    }

    def find_class(self, module: str, name: str) -> object:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _unpickle(data: bytes, where: str) -> dict:
    try:
        obj = _ArrayUnpickler(io.BytesIO(data), encoding="bytes").load()
    except Exception as exc:  # any unpickling failure means a corrupted batch
        raise DataError(f"{where}: not a CIFAR-10 pickle batch ({exc})") from exc
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a dict, found {type(obj).__name__}")
    return obj


def _batch(data: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    obj = _unpickle(data, where)
    try:
        x = np.asarray(obj[b"data"])
        y = np.asarray(obj[b"labels"], dtype=np.int64)
    except KeyError as exc:
        raise DataError(f"{where}: no {exc.args[0]!r} entry") from None
    if x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != 3 * 32 * 32:
        raise DataError(f"{where}: data is {x.dtype} {x.shape}, expected uint8 [N, 3072]")
    if len(y) != len(x):
        raise DataError(f"{where}: {len(y)} labels for {len(x)} images")
    return x.reshape(-1, 3, 32, 32), y


def _from_batches(read: Callable[[str], bytes], where: str) -> CifarArrays:
    meta = _unpickle(read(_META), f"{where}/{_META}")
    try:
        classes = tuple(n.decode() for n in meta[b"label_names"])
    except (KeyError, AttributeError) as exc:
        raise DataError(f"{where}/{_META}: no list of label_names ({exc})") from None
    parts = [_batch(read(name), f"{where}/{name}") for name in _TRAIN_BATCHES]
    test_x, test_y = _batch(read(_TEST_BATCH), f"{where}/{_TEST_BATCH}")
    train_x = np.concatenate([p[0] for p in parts])
    train_y = np.concatenate([p[1] for p in parts])
    for name, y in (("train", train_y), ("test", test_y)):
        if len(y) and (y.min() < 0 or y.max() >= len(classes)):
            raise DataError(f"{where}: {name} labels outside 0..{len(classes) - 1}")
    return CifarArrays(train_x, train_y, test_x, test_y, classes)


def _member_bytes(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    """The content of a regular file of the archive."""
    data = tar.extractfile(member)
    if data is None:  # isfile() was checked: tarfile gives None only for other members
        raise tarfile.TarError(f"{member.name} is not a regular file")
    return data.read()


def _from_tarball(path: Path) -> CifarArrays:
    try:
        with tarfile.open(path, "r|gz") as tar:  # one sequential pass
            members = {
                Path(m.name).name: _member_bytes(tar, m)
                for m in tar
                if m.isfile() and Path(m.name).parent.name == BATCHES_DIR
            }
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: not a valid tar.gz archive or truncated ({exc})") from exc

    def read(name: str) -> bytes:
        if name not in members:
            raise DataError(f"{path}: the archive has no {BATCHES_DIR}/{name}")
        return members[name]

    return _from_batches(read, str(path))


def _from_zip(path: Path) -> CifarArrays:
    try:
        with zipfile.ZipFile(path) as zf:
            names = [i.filename for i in zf.infolist() if not i.is_dir()]
            images = [n for n in names if n.lower().endswith(_IMAGE_SUFFIXES)]
            return _from_image_tree(str(path), images, zf.read)
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise DataError(f"{path}: not a valid zip archive or truncated ({exc})") from exc


def _from_image_tree(where: str, names: Iterable[str], read: Callable[[str], bytes]) -> CifarArrays:
    """Decode ``.../{train,test}/<class>/<file>`` entries named by ``names``."""
    try:
        from PIL import Image, UnidentifiedImageError  # only image-folder sources need it
    except ImportError as exc:
        raise ImportError(f"{where}: decoding images needs Pillow (pip install pillow)") from exc

    splits: dict[str, list[tuple[str, str]]] = {"train": [], "test": []}
    for name in names:
        parts = name.split("/")
        if len(parts) >= 3 and parts[-3] in splits and not parts[-1].startswith("."):
            splits[parts[-3]].append((parts[-2], name))
    if not splits["train"]:
        raise DataError(f"{where}: no images under train/<class>/")
    classes = tuple(sorted({c for c, _ in splits["train"]}))
    unknown = sorted({c for c, _ in splits["test"]} - set(classes))
    if unknown:
        raise DataError(f"{where}: test classes {unknown} have no train folder")
    index = {c: i for i, c in enumerate(classes)}
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    shape: tuple[int, ...] | None = None
    for split, entries in splits.items():
        entries.sort(key=lambda e: (index[e[0]], e[1]))
        x = None
        for k, (_, name) in enumerate(entries):
            try:
                with Image.open(io.BytesIO(read(name))) as im:
                    pixels = np.asarray(im if im.mode == "RGB" else im.convert("RGB"))
            except (UnidentifiedImageError, OSError, SyntaxError) as exc:
                raise DataError(f"{where}: {name}: cannot decode the image ({exc})") from exc
            if shape is None:
                shape = pixels.shape
            if pixels.shape != shape:
                raise DataError(f"{where}: {name} is {pixels.shape}, other images are {shape}")
            if x is None:
                x = np.empty((len(entries), *shape), dtype=np.uint8)
            x[k] = pixels
        if x is not None:
            y = np.array([index[c] for c, _ in entries], dtype=np.int64)
            out[split] = (np.ascontiguousarray(x.transpose(0, 3, 1, 2)), y)
    test = out.get("test")
    return CifarArrays(
        out["train"][0],
        out["train"][1],
        None if test is None else test[0],
        None if test is None else test[1],
        classes,
    )


def _cached(
    source: Path, fingerprint: str, cache_dir: Path | None, decode: Callable[[], CifarArrays]
) -> CifarArrays:
    """``decode()``, or its result stored in ``cache_dir`` for this source fingerprint."""
    if cache_dir is None:
        return decode()
    key = hashlib.sha256(f"{_CACHE_VERSION}|{source.resolve()}|{fingerprint}".encode()).hexdigest()[
        :20
    ]
    path = cache_dir / f"cifar10-{key}.npz"
    try:
        with np.load(path, allow_pickle=False) as z:
            has_test = bool(z["has_test"])
            return CifarArrays(
                z["train_x"],
                z["train_y"],
                z["test_x"] if has_test else None,
                z["test_y"] if has_test else None,
                tuple(str(c) for c in z["classes"]),
            )
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        pass  # no cache entry yet, or an unreadable one: decode and (re)write it
    arrays = decode()
    empty = np.zeros((0, *arrays.train_x.shape[1:]), dtype=np.uint8)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=path.stem, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(
                    f,
                    train_x=arrays.train_x,
                    train_y=arrays.train_y,
                    test_x=empty if arrays.test_x is None else arrays.test_x,
                    test_y=np.zeros(0, np.int64) if arrays.test_y is None else arrays.test_y,
                    classes=np.array(arrays.classes),
                    has_test=np.array(arrays.test_x is not None),
                )
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        warnings.warn(f"could not cache decoded CIFAR-10 in {cache_dir}: {exc}", stacklevel=3)
    return arrays
