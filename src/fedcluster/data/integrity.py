"""Local dataset files checked against the SHA-256 pins of the downloader.

The downloader (:mod:`fedcluster.data.download`) accepts a file only when its
SHA-256 is pinned; files already on disk were trusted until now (issue 13: a
local MNIST label file with every label set to 0, valid gzip and header,
trained and reported accuracy 1.0). Two checks use the same pins:

- :func:`verify_data_dir` (``fedcluster verify [--data-dir DIR]``): every
  pinned file of a data root is ``ok``, ``differs`` or ``missing``;
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
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fedcluster.data.download import SOURCES

log = logging.getLogger("fedcluster")

Status = Literal["ok", "differs", "missing"]

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


def verify_data_dir(root: Path) -> list[FileCheck]:
    """Every pinned file under ``root``: ok, differs (with its digest) or missing."""
    checks = []
    for key, pins in sorted(PINS.items()):
        path = root / key
        if not path.is_file():
            checks.append(FileCheck(key, "missing"))
            continue
        got = sha256_of(path)
        checks.append(FileCheck(key, "ok" if got in pins else "differs", got))
    return checks


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
