"""Large blocks of parameter rows on transparent huge pages (Linux).

A training round writes its trained rows into a fresh ``[n, d]`` block (150 MB
for the round benchmark's 80 clients × 468,874 parameters, 1.5 GB for IFCA's
2,400 clients). The allocator maps such blocks fresh from the kernel, so the
first write of every 4 KiB page is a page fault: 37,000 per round for the
benchmark's block. Under KVM a fault costs about 2 µs (on the Zen 4 machine of
docs/benchmarks.md, "Roofline on AVX-512": allocating and
filling the block took 103 ms on one core, filling it again 21 ms), a quarter of
a core's round. ``madvise(MADV_HUGEPAGE)`` before the first write makes the
kernel back the block with 2 MiB pages where transparent huge pages are enabled
for it (``/sys/kernel/mm/transparent_hugepage/enabled`` = ``always`` or
``madvise``): 512 times fewer faults (the same fill took 20 ms).

Even on huge pages the kernel zeroes every page of a fresh block (12 ms per
150 MB round on one core), and the pages' first writes scatter that cost over
the round's copies. :class:`RowBlocks` hands the previous round's block out
again once nobody else holds it, so a simulator that trains round after round
touches no fresh memory.

The advice changes only where memory comes from, never a value. Elsewhere
(another OS, THP ``never``, a GPU tensor, a small block) the block is an
ordinary ``torch.empty_like``.
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE = 2 * 2**20
"""Bytes of an x86-64/arm64 transparent huge page."""

_MADV_HUGEPAGE = 14


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def empty_rows_like(like: torch.Tensor) -> torch.Tensor:
    """``torch.empty_like(like)``, advised onto huge pages before anything touches it
    (on Linux CPUs, for blocks of at least two huge pages; the advice is a hint:
    where the kernel declines it the block is ordinary memory)."""
    out = torch.empty_like(like)
    if _MADVISE is None or out.device.type != "cpu" or out.nbytes < 2 * HUGE_PAGE:
        return out
    lo = -(-out.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # the whole huge pages inside
    hi = (out.data_ptr() + out.nbytes) // HUGE_PAGE * HUGE_PAGE
    if hi > lo:
        _MADVISE(lo, hi - lo, _MADV_HUGEPAGE)
    return out


def _storage_users(storage: torch.UntypedStorage) -> int | None:
    """How many tensors and storage objects hold ``storage`` (``None`` where
    PyTorch does not say)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else int(count(storage._cdata))


class RowBlocks:
    """Blocks of rows for successive rounds, each the previous one's memory when
    that block is no longer used.

    :meth:`empty_like` is :func:`empty_rows_like`, except that it returns the
    memory of the block it gave out last when that block has the same size and
    device and no tensor outside this object still refers to it (the caller
    dropped the round's rows and every view of them): its values are then the
    old round's, so the caller must write every element (as the simulator's
    training does). One block stays allocated between rounds.
    """

    def __init__(self) -> None:
        self._kept: torch.UntypedStorage | None = None

    def empty_like(self, like: torch.Tensor) -> torch.Tensor:
        kept = self._kept
        shape = tuple(like.shape)
        if (
            kept is not None
            and kept.device == like.device
            and kept.nbytes() == like.numel() * like.element_size()
            and _storage_users(kept) == 1
        ):
            stride = torch.empty(shape, device="meta").stride()  # contiguous, as set_'s default
            return torch.empty(0, dtype=like.dtype, device=like.device).set_(kept, 0, shape, stride)
        self._kept = None  # the old block goes once its users drop it
        out = empty_rows_like(like)
        if out.is_contiguous() and _storage_users(out.untyped_storage()) is not None:
            self._kept = out.untyped_storage()
        return out
