"""Clients' data checked once at load: finite, in range, and enough of it.

One NaN pixel in one client's file, pixels of 1e30 (finite, but the first
layer's sums overflow), labels outside the classes, or a client with no
training or test samples (a LEAF user with 0 samples; ``n_clients: 4999`` on
5,000 samples, which left one test sample and reported 0.0 accuracy) are found
here, per client, before any training. ``data.bad_clients`` says what happens:

- ``exclude`` (default): the bad clients are named in one warning and left out
  of the federation (the others keep their order and are numbered 0..n−k−1);
- ``refuse``: the run stops with one :class:`~fedcluster.errors.DataError`
  naming them.

When more than half of the clients are bad the run is refused either way: that
is a wrong partition or dataset, not a few bad clients.
"""

from __future__ import annotations

import logging
from typing import Literal

import numpy as np
import torch

from fedcluster.data.federation import Federation, require_integer_labels
from fedcluster.errors import DataError

log = logging.getLogger("fedcluster")

BadClients = Literal["exclude", "refuse"]
MAX_INPUT = 1e6
"""Largest absolute input value accepted: images are in [0, 1] and token ids below the
vocabulary size; 1e6 leaves room for a user's own features while a first layer's sum of
a few thousand such values stays far inside float32."""
SHOWN = 5
"""Bad clients named in a message (then a count of the others)."""
MAX_CLASSES = 100_000
"""The most classes a federation may have (ImageNet-21k has 21,841): the model's output
layer is built from it."""
MAX_FEATURES = 2**24
"""The most input values per sample (16.7 M: 3 × 2,365² pixels)."""


def clients_with(bad_rows: torch.Tensor, offsets: np.ndarray) -> np.ndarray:
    """Clients (client c owns rows ``offsets[c]:offsets[c+1]``) owning a row where
    ``bad_rows`` is True, sorted."""
    rows = torch.nonzero(bad_rows).flatten().cpu().numpy()
    return np.unique(np.searchsorted(offsets, rows, side="right") - 1)


def find_bad_clients(federation: Federation) -> dict[int, str]:
    """Client -> what is wrong with its data (empty when every client is sound)."""
    problems: dict[int, list[str]] = {}
    splits = (
        ("training", federation.x_train, federation.y_train, federation.train_offsets),
        ("test", federation.x_test, federation.y_test, federation.test_offsets),
    )
    for split, x, y, offsets in splits:
        for c in np.flatnonzero(np.diff(offsets) == 0):
            problems.setdefault(int(c), []).append(f"no {split} samples")
        for what, rows in bad_samples(x, y, federation.n_classes, split):
            for c in clients_with(rows, offsets):
                problems.setdefault(int(c), []).append(what)
    return {c: ", ".join(why) for c, why in sorted(problems.items())}


def bad_samples(
    x: torch.Tensor, y: torch.Tensor | None, n_classes: int, split: str
) -> list[tuple[str, torch.Tensor]]:
    """What can be wrong with samples ``x`` [N, ...] and labels ``y`` [N] (None: no labels)
    of one ``split``, each with its mask over the samples: non-finite or huge float
    inputs, negative token ids, labels outside ``0..n_classes-1``."""
    flat = x.reshape(len(x), -1) if x.numel() else x.reshape(len(x), 0)
    if flat.is_floating_point():
        finite = torch.isfinite(flat).all(dim=1)
        found = [
            (f"non-finite {split} inputs (NaN or Inf)", ~finite),
            (f"{split} inputs beyond ±{MAX_INPUT:g}", finite & (flat.abs() > MAX_INPUT).any(dim=1)),
        ]
    else:
        found = [(f"negative {split} token ids", (flat < 0).any(dim=1))]
    if y is not None:
        found.append((f"{split} labels outside 0..{n_classes - 1}", (y < 0) | (y >= n_classes)))
    return found


def check_given(federation: Federation) -> Federation:
    """A federation passed from Python, checked where a file's loader would have: integer
    labels (float labels would be truncated) and 1..:data:`MAX_CLASSES` classes; its
    clients are then screened like a file's (:func:`screen_clients`)."""
    if not 1 <= int(federation.n_classes) <= MAX_CLASSES:
        raise DataError(f"federation: n_classes is {federation.n_classes}, not in 1..{MAX_CLASSES}")
    for split, y in (("train", federation.y_train), ("test", federation.y_test)):
        require_integer_labels(y, f"federation: its {split} labels")
    return federation


def screen_clients(federation: Federation, policy: BadClients) -> Federation:
    """``federation`` without its bad clients, or a :class:`DataError` (see the module)."""
    bad = find_bad_clients(federation)
    if not bad:
        return federation
    n = federation.n_clients
    shown = "; ".join(f"client {c}: {why}" for c, why in list(bad.items())[:SHOWN])
    more = f"; and {len(bad) - SHOWN} more" if len(bad) > SHOWN else ""
    if policy == "refuse" or 2 * len(bad) > n:
        hint = (
            "fix the data or the partition (fewer clients?)"
            if 2 * len(bad) > n
            else "fix the data, or set data.bad_clients: exclude"
        )
        raise DataError(f"{len(bad)} of {n} clients have unusable data ({shown}{more}); {hint}")
    log.warning(
        "data: excluded %d of %d clients with unusable data (%s%s); the other %d keep their "
        "order, numbered 0..%d (data.bad_clients: refuse stops the run instead)",
        len(bad),
        n,
        shown,
        more,
        n - len(bad),
        n - len(bad) - 1,
    )
    return federation.subset([c for c in range(n) if c not in bad])
