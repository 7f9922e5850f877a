"""Large blocks of parameter rows on transparent huge pages (Linux).

A training round writes its trained rows into a fresh ``[n, d]`` block (150 MB
for the round benchmark's 80 clients × 468,874 parameters, 1.5 GB for IFCA's
2,400 clients). The allocator maps such blocks fresh from the kernel, so the
first write of every 4 KiB page is a page fault: 37,000 per round for the
benchmark's block. Under KVM a fault costs about 2 µs (on the Zen 4 machine of
docs/benchmarks.md, "Roofline on AVX-512 (issue 25 item 4)": allocating and
filling the block took 103 ms on one core, filling it again 21 ms), a quarter of
a core's round. ``madvise(MADV_HUGEPAGE)`` before the first write makes the
kernel back the block with 2 MiB pages where transparent huge pages are enabled
for it (``/sys/kernel/mm/transparent_hugepage/enabled`` = ``always`` or
``madvise``): 512 times fewer faults (the same fill took 20 ms).

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
