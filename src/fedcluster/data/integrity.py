"""Local dataset files checked against the SHA-256 pins of the downloader.

The downloader (:mod:`fedcluster.data.download`) accepts a file only when its
SHA-256 is pinned; files already on disk are checked too (a
local MNIST label file with every label set to 0, valid gzip and header,
trained and reported accuracy 1.0). Two checks use the same pins:

- :func:`verify_data_dir` (``fedcluster verify [--data-dir DIR]``): every
  pinned file of a data root is ``ok``, ``differs``, ``missing``, ``absent``
  (its dataset is not there) or ``unreadable``, and an uncompressed twin of a
  pinned ``.gz`` is ``ignored`` or, when the loader would read it, ``unpinned``;
- :func:`warn_if_modified`, called when a dataset file is read: a known file
  whose digest is none of its pins gets one warning naming it. The verdict is
  cached per (path, mtime, size), so repeated loads in a process cost nothing.

A file is *known* by its place under the data root (``<folder>/<name>``, e.g.
``mnist/train-labels-idx1-ubyte.gz``); files of other names (a user's own
data) are not checked.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fedcluster.data.download import SOURCES

log = logging.getLogger("fedcluster")

Status = Literal["ok", "differs", "missing", "absent", "unreadable", "ignored", "unpinned"]

PINS: dict[str, tuple[str, ...]] = {
    f.path: f.sha256 for alternatives in SOURCES.values() for files in alternatives for f in files
}
"""Known file (``<folder>/<name>`` under the data root) -> accepted SHA-256 digests."""

_verdicts: dict[tuple[str, int, int], bool] = {}  # (path, mtime_ns, size) -> digest pinned
_warned: set[tuple[str, int, int]] = set()


@dataclass(frozen=True)
class FileCheck:
    """The verdict on one pinned file of a data root."""

    path: str
    status: Status
    sha256: str | None = None
    reason: str | None = None
    """Why an ``unreadable`` file cannot be read."""


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def known_name(path: Path) -> str | None:
    """``<folder>/<name>`` if that is a pinned file, else None."""
    key = f"{path.parent.name}/{path.name}"
    return key if key in PINS else None


def _check(root: Path, key: str, pins: tuple[str, ...]) -> FileCheck:
    path = root / key
    try:
        got = sha256_of(path)
    except OSError as exc:  # a symlink loop, a directory, no permission
        return FileCheck(key, "unreadable", reason=exc.strerror or str(exc))
    return FileCheck(key, "ok" if got in pins else "differs", got)


def verify_data_dir(root: Path) -> list[FileCheck]:
    """Every pinned file under ``root``, and the uncompressed twins the loader would read.

    A dataset none of whose files exist is ``absent`` (not an error); one with
    some of its files present has the others ``missing``. A file that exists but
    cannot be read is ``unreadable``. An uncompressed twin ``X`` of a pinned
    ``X.gz`` is ``ignored`` when ``X.gz`` is there (the loader reads the pinned
    file, :func:`fedcluster.data.idx.find_idx_file`) and ``unpinned`` when it is the
    file the loader would read.
    """
    checks = []
    for alternatives in SOURCES.values():
        keys = [[f.path for f in files] for files in alternatives]
        present = [[os.path.lexists(root / k) for k in alt] for alt in keys]
        complete = any(all(p) for p in present)
        for alt, there in zip(keys, present, strict=True):
            for key, exists in zip(alt, there, strict=True):
                if exists:
                    checks.append(_check(root, key, PINS[key]))
                else:
                    partial = any(there) and not complete
                    checks.append(FileCheck(key, "missing" if partial else "absent"))
                twin = key.removesuffix(".gz")
                if twin != key and os.path.lexists(root / twin):
                    checks.append(FileCheck(twin, "ignored" if exists else "unpinned"))
    return sorted(checks, key=lambda c: c.path)


FAILING: frozenset[Status] = frozenset({"differs", "missing", "unreadable", "unpinned"})
"""Verdicts that make ``fedcluster verify`` exit 1."""


def warn_if_modified(path: Path) -> bool:
    """Warn once if ``path`` is a known dataset file whose SHA-256 is not pinned.

    Returns whether the file is known and differs. Unknown files return False
    without being read.
    """
    key = known_name(path)
    if key is None or not path.is_file():
        return False
    stat = path.stat()
    cache_key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    pinned = _verdicts.get(cache_key)
    if pinned is None:
        pinned = sha256_of(path) in PINS[key]
        _verdicts[cache_key] = pinned
    if not pinned and cache_key not in _warned:
        _warned.add(cache_key)
        log.warning(
            "%s: SHA-256 matches none of the pinned digests of %s; the file was modified or "
            "corrupted (run `fedcluster verify` to check every dataset file)",
            path,
            key,
        )
    return not pinned
