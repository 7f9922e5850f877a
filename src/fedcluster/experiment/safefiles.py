"""Files of a run directory opened without following symlinks.

A run directory can be shared or copied from elsewhere; a symlink planted at
``.lock``, ``metrics.csv.tmp``, ``summary.json.tmp`` or ``<job>.pt.tmp`` made a
resume write through it to a file outside the directory. Every file here is
opened with ``O_NOFOLLOW``; a temporary is created with ``O_EXCL`` (a stale
regular one, left by a killed run, is removed first; anything else at its
name is refused), then renamed over its target, which replaces a symlink at
the target rather than writing through it. A refused entry is one
:class:`~fedcluster.errors.FedclusterError` naming it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from fedcluster.errors import FedclusterError

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def _refused(path: Path, exc: OSError) -> FedclusterError:
    return FedclusterError(
        f"{path} is a symlink or not a regular file ({exc.strerror}); a run directory's "
        "entries must be plain files: remove it"
    )


def open_fd(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` of ``path`` that refuses a symlink or a non-regular file; a FIFO is
    opened without blocking (``O_NONBLOCK``, which a regular file ignores) and refused."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise _refused(path, exc) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refused(path, OSError(errno.EINVAL, "not a regular file"))
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write ``path`` through ``<path>.tmp`` (created exclusively) and a rename.

    On any failure (a full disk: ``ENOSPC``) the temporary is removed and ``path``
    keeps its previous content; an ``OSError`` names ``path``.
    """
    blob = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(path.name + ".tmp")
    if os.path.lexists(tmp):
        if tmp.is_symlink() or not tmp.is_file():
            raise _refused(tmp, OSError(errno.ELOOP, "refusing to write through it"))
        tmp.unlink()  # a stale temporary of a killed run
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    except FileExistsError as exc:  # created between the check and the open
        raise _refused(tmp, exc) from None
    try:
        try:
            _write_all(fd, blob)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:  # os.write names no file
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise


def append(path: Path, text: str) -> None:
    """Append ``text`` to ``path`` (created if missing), refusing a symlink."""
    fd = open_fd(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        _write_all(fd, text.encode())
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    finally:
        os.close(fd)


def read_bytes(path: Path) -> bytes:
    """The content of ``path``, refusing a symlink."""
    fd = open_fd(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        return f.read()
