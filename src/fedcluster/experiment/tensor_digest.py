"""SHA-256 digests of every value a checkpoint stores, checked before it is used.

A checkpoint's metadata carries, for each leaf of its stored trees (the server
state, the cluster assignments), the SHA-256 of its type, and for a tensor its
dtype, shape and bytes in memory order; for any other leaf (a number, a
string) its ``repr``. A flipped bit, zeroed storage or an altered number in the
file gives another digest: :func:`first_mismatch` names the leaf, and resuming
stops before anything is written (:func:`fedcluster.experiment.rundir.load_checkpoint`).
The zip container's CRC does not do this: torch does not check it on load.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch


def _leaves(tree: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _leaves(value, f"{path}/{key}")
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            yield from _leaves(value, f"{path}/{i}")
    else:
        yield path, tree


def leaf_digest(value: Any) -> str:
    """SHA-256 of one stored value: a tensor's dtype, shape and bytes; else its type and
    ``repr``."""
    h = hashlib.sha256()
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"tensor {t.dtype} {tuple(t.shape)}\n".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(f"{type(value).__name__} {value!r}".encode())
    return h.hexdigest()


def digests(trees: Mapping[str, Any]) -> dict[str, str]:
    """``{leaf path: SHA-256}`` of every leaf of ``trees`` (paths like ``state/centers``)."""
    return {path: leaf_digest(value) for path, value in _leaves(trees, "")}


def first_mismatch(trees: Mapping[str, Any], recorded: Mapping[str, str]) -> str | None:
    """What differs between ``trees`` and the ``recorded`` digests (the first leaf, by
    path), or ``None`` when every leaf matches."""
    if not isinstance(recorded, Mapping):
        return "its recorded SHA-256 digests are not a table"
    found = digests(trees)
    for path in sorted(set(found) | set(recorded)):
        if path not in recorded:
            return f"{path.lstrip('/')} has no recorded SHA-256"
        if path not in found:
            return f"{path.lstrip('/')} is missing"
        if found[path] != recorded[path]:
            return f"{path.lstrip('/')} does not match its SHA-256"
    return None
