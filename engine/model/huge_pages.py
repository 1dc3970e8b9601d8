"""Weight buffers in 2 MB pages (Linux's transparent huge pages, asked for with madvise).

At small batches a decode step streams every weight from memory once, and with 4 KB pages each
page of a weight costs the core's page walker a TLB miss: on a 2-core EPYC, Gemma 3's 180 MB
LM head at one row took 8.6 ms from 4 KB pages and 7.6 ms from 2 MB ones, side by side. Most
machines leave transparent huge pages to `madvise` (/sys/kernel/mm/transparent_hugepage/enabled),
so a buffer gets them only if it asks before its pages are first touched: `empty` asks, then the
caller fills it. Where the kernel says no (another OS, huge pages off or none free), the buffer
has 4 KB pages and nothing else changes.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from typing import Any

import torch

HUGE = 2 << 20
# Smaller buffers share chunks of this size (a model's per-layer weights are a few MB each); of a
# chunk, only the 2 MB pages that hold what it has handed out become resident.
CHUNK = 16 * HUGE
_ALIGN = 64
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def _allocate(nbytes: int) -> torch.Tensor:
    """nbytes from a fresh allocation, its start on a 2 MB boundary, asked to be in huge pages."""
    whole = torch.empty(nbytes + HUGE, dtype=torch.uint8)  # large: its pages are untouched so far
    skip = -whole.data_ptr() % HUGE
    view = whole[skip : skip + nbytes]
    _madvise()(view.data_ptr(), nbytes, _MADV_HUGEPAGE)  # a refusal (EINVAL: THP off) leaves 4 KB pages
    return view


_lock = threading.Lock()
_chunk: torch.Tensor | None = None  # the current chunk
_used = 0  # its bytes handed out


def empty(nbytes: int) -> torch.Tensor:
    """An uninitialized uint8 CPU tensor of `nbytes` (64-byte aligned), in 2 MB pages where the OS
    grants them: its own allocation, or from a chunk shared with other small buffers (the chunk is
    freed with the last of them, once a newer chunk has taken its place here)."""
    global _chunk, _used
    if _madvise() is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    if nbytes > CHUNK // 4:
        return _allocate(nbytes)
    with _lock:
        if _chunk is None or _used + nbytes > CHUNK:
            _chunk, _used = _allocate(CHUNK), 0
        out = _chunk[_used : _used + nbytes]
        _used += -(-nbytes // _ALIGN) * _ALIGN
    return out


def like(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of tensor `t`, in a buffer from `empty` where it is on the CPU (for weights
    the kernels stream)."""
    if t.device.type != "cpu":
        return t.contiguous()
    out = empty(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
