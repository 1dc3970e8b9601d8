"""Weight buffers in 2 MB pages (engine/model/huge_pages.py)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from ppserve.engine.model import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(a, 16) for a in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return []


def test_buffers_hold_what_is_written_aligned() -> None:
    big = huge_pages.empty(3 * huge_pages.CHUNK)  # its own allocation
    small = [huge_pages.empty(n) for n in (100, 5000, 1 << 20)]  # sharing chunks
    assert big.numel() == 3 * huge_pages.CHUNK and big.data_ptr() % huge_pages.HUGE == 0
    assert [t.numel() for t in small] == [100, 5000, 1 << 20]
    assert all(t.data_ptr() % 64 == 0 and t.dtype == torch.uint8 for t in small)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in small)
    assert all(a_end <= b for (_, a_end), (b, _) in itertools.pairwise(spans)), "buffers overlap"
    for i, t in enumerate([big, *small]):
        t.fill_(i + 1)
    assert all(bool((t == i + 1).all()) for i, t in enumerate([big, *small]))
    w = torch.randn(300, 7000)
    copied = huge_pages.like(w.T)
    assert copied.is_contiguous() and torch.equal(copied, w.T)


@pytest.mark.skipif(not THP.exists(), reason="a kernel without transparent huge pages refuses the advice")
def test_buffers_are_advised_into_huge_pages() -> None:
    """Whether the kernel then gives 2 MB pages (THP not `never`, some free) is its own affair; what
    ppserve does is ask, for the big buffers and the chunks the small ones share."""
    for t in (huge_pages.empty(3 * huge_pages.CHUNK), huge_pages.empty(4096)):
        assert "hg" in _vm_flags(t.data_ptr())  # madvise(MADV_HUGEPAGE) on its range


def test_without_madvise_it_is_a_plain_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where there is no madvise, `empty` is torch.empty: no 2 MB over-allocation, no shared chunk.
    (Not checked through VmFlags: whether a fresh mapping shows `hg` is the allocator's and the
    kernel's affair once other buffers in the process have asked for huge pages.)"""
    monkeypatch.setattr(huge_pages, "_madvise", lambda: None)  # as on an OS without it
    monkeypatch.setattr(huge_pages, "_allocate", lambda nbytes: pytest.fail("asked for huge pages"))
    for nbytes in (3 * huge_pages.CHUNK, 4096):
        t = huge_pages.empty(nbytes)
        assert t.numel() == nbytes and t.storage_offset() == 0
        assert t.untyped_storage().nbytes() == nbytes  # its own storage, not a view of a chunk
