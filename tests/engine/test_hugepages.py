"""Blocks of trained rows advised onto transparent huge pages (engine.hugepages)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fedcluster.engine.hugepages import HUGE_PAGE, RowBlocks, empty_rows_like

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _vma_flags(address: int) -> dict[str, str]:
    """The /proc/self/smaps entries of the mapping that holds ``address``."""
    entries: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside:
            key, _, value = line.partition(":")
            entries[key] = value.strip()
    return entries


def test_the_block_is_an_empty_like_of_the_start():
    start = torch.zeros(1000).expand(3, -1)  # a broadcast start row, as FedAvg's
    out = empty_rows_like(start)
    assert out.shape == start.shape and out.dtype == start.dtype and out.is_contiguous()
    small = empty_rows_like(torch.zeros(4, 5, dtype=torch.float64))
    assert small.shape == (4, 5) and small.dtype == torch.float64


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="needs Linux with transparent huge pages enabled",
)
def test_a_large_block_is_eligible_for_huge_pages():
    out = empty_rows_like(torch.zeros(4, 2 * HUGE_PAGE // 4))  # 8 MiB
    inner = -(-out.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    assert _vma_flags(inner).get("THPeligible") == "1"
    out.fill_(1.0)  # usable as ordinary memory
    assert float(out.sum()) == out.numel()


def test_a_dropped_block_is_reused_and_a_held_one_is_not():
    blocks = RowBlocks()
    start = torch.zeros(1000).expand(3, -1)
    first = blocks.empty_like(start)
    first.fill_(1.0)
    address = first.data_ptr()
    view = first[1]  # a view still uses the memory
    del first
    second = blocks.empty_like(start)
    assert second.data_ptr() != address
    second.fill_(2.0)
    assert torch.equal(view, torch.ones(1000))  # the held rows keep their values
    address = second.data_ptr()
    del second
    third = blocks.empty_like(start)  # nothing holds the second block now
    assert third.data_ptr() == address
    assert third.shape == start.shape and third.dtype == start.dtype and third.is_contiguous()
    assert blocks.empty_like(torch.zeros(3, 999)).shape == (3, 999)  # another size: fresh
