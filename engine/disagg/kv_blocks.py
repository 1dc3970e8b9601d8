"""KV cache blocks as they leave one pipeline and enter another (prefill/decode disaggregation).

Prefill and decode servers may cut the model differently (prefill PP=3 as 1,1,2 layers, decode
PP=2 as 3,1), so each prefill stage sends the KV of its own layers to whichever decode stage(s)
own them: `layer_slices` pairs them up. KV always travels in blocks (a request's block table,
in order), never as one tensor per request, so a transfer can stream block by block and the
receiver writes straight into the blocks it allocated. Block ids differ between the two sides;
the block size must not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerSlice:
    """Layers that prefill stage `src` sends to decode stage `dst` (global layer indices)."""

    src: int
    dst: int
    layers: range


def layer_slices(src_ranges: Sequence[range], dst_ranges: Sequence[range]) -> list[LayerSlice]:
    """Every (prefill stage, decode stage) pair that shares layers, with the layers they share.
    Both sides must cover the same layers in order (the same model)."""
    if not src_ranges or not dst_ranges or src_ranges[-1].stop != dst_ranges[-1].stop:
        raise ValueError(f"the two sides hold different layers: {list(src_ranges)} vs {list(dst_ranges)}")
    slices = []
    for s, src in enumerate(src_ranges):
        for d, dst in enumerate(dst_ranges):
            lo, hi = max(src.start, dst.start), min(src.stop, dst.stop)
            if lo < hi:
                slices.append(LayerSlice(s, d, range(lo, hi)))
    return slices


def read_blocks(kv_cache: torch.Tensor, own: range, layers: range, blocks: Sequence[int]) -> torch.Tensor:
    """A copy of `blocks` of `layers` from a stage's cache (which holds layers `own`):
    [len(layers), 2, len(blocks), block_size, kv_heads, head_dim], contiguous, ready to send."""
    lo, hi = _local(own, layers)
    index = torch.tensor(list(blocks), dtype=torch.long, device=kv_cache.device)
    return kv_cache[lo:hi].index_select(2, index).contiguous()


def write_blocks(kv_cache: torch.Tensor, own: range, layers: range, blocks: Sequence[int], data: torch.Tensor) -> None:
    """Write what `read_blocks` produced on the other side into this stage's `blocks`."""
    lo, hi = _local(own, layers)
    expected = (hi - lo, 2, len(blocks), *kv_cache.shape[3:])
    if tuple(data.shape) != expected:
        raise ValueError(f"KV data of shape {tuple(data.shape)} for {len(blocks)} blocks, expected {expected}")
    index = torch.tensor(list(blocks), dtype=torch.long, device=kv_cache.device)
    kv_cache[lo:hi].index_copy_(2, index, data.to(device=kv_cache.device, dtype=kv_cache.dtype))


def _local(own: range, layers: range) -> tuple[int, int]:
    if layers.start < own.start or layers.stop > own.stop or not layers:
        raise ValueError(f"layers {layers.start}..{layers.stop - 1} are not all in this stage's {own}")
    return layers.start - own.start, layers.stop - own.start
