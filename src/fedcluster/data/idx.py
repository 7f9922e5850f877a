"""Readers for IDX files (MNIST, Fashion-MNIST, EMNIST), raw or gzip-compressed.

An IDX file is a 4-byte magic number -- two zero bytes, a type code and the
number of dimensions -- then one big-endian ``uint32`` per dimension, then the
values in C order. Every check failure raises :class:`~fedcluster.errors.DataError`
with the file path and what is wrong.
"""

from __future__ import annotations

import gzip
import math
import os
import stat
import zlib
from pathlib import Path
from typing import IO

import numpy as np

from fedcluster.data.integrity import warn_if_modified
from fedcluster.errors import DataError

# IDX type code -> big-endian NumPy dtype.
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"


def find_idx_file(folder: Path, name: str) -> Path | None:
    """The path of ``name.gz`` or else ``name`` in ``folder``; None if neither exists.

    The compressed file comes first: it is the one the downloader pins and
    ``fedcluster verify`` checks, so an uncompressed twin beside it is never read.
    """
    for candidate in (folder / f"{name}.gz", folder / name):
        if candidate.is_file():
            return candidate
    return None


MAX_IDX_BYTES = 2**31
"""Largest IDX payload read (2 GiB; EMNIST byclass's training images, the largest
pinned file, hold 547 MB): a gzip bomb stops here, not at the end of memory."""


def _read_bytes(path: Path) -> bytes:
    """The file's content, gunzipped if it is gzip data (whatever its name).

    The stream is read no further than its IDX header's size (plus one byte, so
    that a longer payload is still reported), at most :data:`MAX_IDX_BYTES`.
    """
    try:
        with open(path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise DataError(f"{path}: not a regular file")
            gzipped = f.read(2) == _GZIP_MAGIC
            f.seek(0)
            if not gzipped and path.suffix == ".gz":
                raise DataError(f"{path}: not a valid gzip file (starts with 0x{f.read(4).hex()})")
            stream = gzip.GzipFile(fileobj=f) if gzipped else f
            try:
                return _read_capped(stream, path)
            except (OSError, EOFError, zlib.error) as exc:
                if not gzipped:
                    raise
                raise DataError(f"{path}: not a valid gzip file or truncated ({exc})") from exc
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read the file ({exc.strerror or exc})") from exc


def _read_capped(stream: IO[bytes] | gzip.GzipFile, path: Path) -> bytes:
    """Header and payload of an IDX stream, read up to the size its header declares."""
    head = stream.read(4)
    if len(head) < 4:
        return head
    dims = stream.read(4 * head[3])
    if len(dims) < 4 * head[3]:
        return head + dims
    shape = np.frombuffer(dims, dtype=">u4").astype(np.int64)
    size = math.prod(shape.tolist()) * _IDX_DTYPES.get(head[2], np.dtype(np.uint8)).itemsize
    if size > MAX_IDX_BYTES:
        raise DataError(
            f"{path}: header declares {size:,} bytes of data, more than the "
            f"{MAX_IDX_BYTES:,} read at most"
        )
    payload = stream.read(size + 1)
    if len(payload) <= size:
        stream.read()  # to the end: a gzip stream checks its length and CRC there
    return head + dims + payload


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """Read an IDX file with ``ndim`` dimensions into a native-endian array.

    Raises:
        DataError: the file is missing, not valid gzip, has a wrong magic number or
            number of dimensions, or its payload size disagrees with its header.
    """
    if path.is_file():
        warn_if_modified(path)  # a known dataset file with an unpinned digest: one warning
    data = _read_bytes(path)
    if len(data) < 4:
        raise DataError(f"{path}: {len(data)} bytes, too short for an IDX header")
    zero1, zero2, code, file_ndim = data[:4]
    if zero1 != 0 or zero2 != 0 or code not in _IDX_DTYPES:
        raise DataError(
            f"{path}: wrong magic number 0x{data[:4].hex()} (an IDX file starts with "
            "0x0000, a type code such as 0x08 for uint8 and the number of dimensions)"
        )
    if file_ndim != ndim:
        raise DataError(
            f"{path}: magic number 0x{data[:4].hex()} says {file_ndim} dimension(s), "
            f"expected {ndim}"
        )
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise DataError(f"{path}: truncated header ({len(data)} bytes, need {header_len})")
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[code]
    expected = math.prod(shape) * dtype.itemsize
    payload = len(data) - header_len
    if payload != expected:
        what = (
            f"{shape[0]} images of {'x'.join(map(str, shape[1:]))}"
            if ndim == 3
            else f"shape {shape}"
        )
        raise DataError(
            f"{path}: header says {what} ({expected} bytes) but the file holds "
            f"{payload} bytes of data"
        )
    array = np.frombuffer(data, dtype=dtype, offset=header_len).reshape(shape)
    return array.astype(dtype.newbyteorder("="), copy=False)


def read_images_and_labels(
    images_path: Path, labels_path: Path, n_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Read an image file ``[N, H, W]`` (uint8) and its label file ``[N]`` (int64).

    Raises:
        DataError: either file is invalid (see :func:`read_idx`), the images are
            not uint8, the counts differ, or a label is outside ``0..n_classes-1``.
    """
    images = read_idx(images_path, ndim=3)
    if images.dtype != np.uint8:
        raise DataError(f"{images_path}: pixels are {images.dtype}, expected uint8")
    labels = read_idx(labels_path, ndim=1).astype(np.int64)
    if len(labels) != len(images):
        raise DataError(
            f"{labels_path}: {len(labels)} labels but {images_path.name} holds {len(images)} images"
        )
    if len(labels) and (labels.min() < 0 or labels.max() >= n_classes):
        raise DataError(
            f"{labels_path}: labels range {labels.min()}..{labels.max()}, expected "
            f"0..{n_classes - 1}"
        )
    return images, labels
