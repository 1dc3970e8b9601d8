"""The paged KV cache of one stage: its own layers only, in up to two groups.

Full-attention layers keep every block of a request; sliding-window layers keep only the blocks
inside their window, from a pool of their own (scheduler/window_kv.py). Each group is one tensor
[group's layers on this stage, 2 (k, v), blocks, block_size, kv_heads, head_dim], indexed by its
own block ids and read through its own block tables and AttentionMetadata. A model without
windows (or whose windows hold any sequence the engine serves) has the full group only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ppserve.engine.model.attention import AttentionMetadata
from ppserve.engine.model.model_config import ModelConfig
from ppserve.scheduler.window_kv import blocks_per_request


def kv_bytes_per_block(cfg: ModelConfig, num_layers: int, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * element


def allocate_kv_cache(
    cfg: ModelConfig, num_layers: int, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[num_layers, 2 (k, v), num_blocks, block_size, kv_heads, head_dim].

    Zeroed, not empty: padded decode batches read (and mask out) slots of other blocks, and a
    masked NaN from uninitialised memory would still poison the weighted sum (0 * NaN = NaN).
    """
    shape = (num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def kv_window(windows: Sequence[int | None], max_model_len: int) -> int | None:
    """The windowed group's window: the largest of the layers' windows that are shorter than the
    longest sequence (a window that holds any sequence is full attention here, and its layer is
    in the full group). None: no windowed group."""
    return max((w for w in windows if w is not None and w < max_model_len), default=None)


def windowed_layers(windows: Sequence[int | None], window: int | None) -> list[bool]:
    """Per layer: whether it is in the windowed group (of window `window`, from `kv_window`)."""
    return [window is not None and w is not None and w <= window for w in windows]


def kv_pools(
    cfg: ModelConfig,
    ranges: Sequence[range],
    window: int | None,
    block_bytes: int,
    budget: int,
    num_blocks: int | None,
    num_window_blocks: int | None,
    max_requests: int,
    max_model_len: int,
    chunk: int,
    block_size: int,
) -> tuple[int, int]:
    """(full group's blocks, windowed group's blocks; 0 without one), for a budget of `budget` bytes
    on the stage that needs most; `block_bytes`: one layer's block. Those given are kept.

    The windowed group gets as many blocks as the full one (a request never holds more there), but
    no more than `max_requests` requests hold at their most (`blocks_per_request`); the full group
    gets the rest. Where no layer is full-attention, the full group holds no KV: its blocks cost
    nothing, and there are enough for `max_requests` requests of `max_model_len` tokens, so that
    only the windowed group's pool limits what runs.
    """
    flags = windowed_layers(cfg.sliding_windows, window)
    stages = [(sum(not flags[i] for i in r), sum(flags[i] for i in r)) for r in ranges]  # (full, windowed)
    if window is None:
        if num_blocks is None:
            num_blocks = budget // (block_bytes * max(f for f, _ in stages))
        return num_blocks, 0
    if not any(f for f, _ in stages):
        if num_window_blocks is None:
            num_window_blocks = num_blocks or budget // (block_bytes * max(w for _, w in stages))
        if num_blocks is None:
            num_blocks = max(max_requests * -(-max_model_len // block_size), num_window_blocks)
        return num_blocks, num_window_blocks
    if num_blocks is not None:
        return num_blocks, num_blocks if num_window_blocks is None else num_window_blocks

    def full_blocks(n_window: int) -> int:  # what is left for the full group beside n_window blocks
        left = [(budget - n_window * w * block_bytes) // (f * block_bytes) for f, w in stages if f]
        fits = all(budget >= n_window * w * block_bytes for _, w in stages)
        return min(left) if fits else -1

    if num_window_blocks is not None:
        return full_blocks(num_window_blocks), num_window_blocks
    capped = max_requests * blocks_per_request(window, chunk, block_size)
    if full_blocks(capped) >= capped:
        return full_blocks(capped), capped
    even = min(budget // ((f + w) * block_bytes) for f, w in stages)
    return even, even


@dataclass(frozen=True)
class StageKvCache:
    """A stage's KV cache by group, and which of its layers reads which."""

    full: torch.Tensor  # [full layers here, 2, blocks, block_size, kv_heads, head_dim]
    window: torch.Tensor | None  # [windowed layers here, 2, window blocks, ...]; None: no windowed group
    where: tuple[tuple[bool, int], ...]  # per local layer: (windowed, its index in its group's tensor)

    @classmethod
    def allocate(
        cls,
        mc: ModelConfig,
        flags: Sequence[bool],
        num_blocks: int,
        num_window_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> StageKvCache:
        """`flags`: per layer of the stage, whether it is windowed (`windowed_layers`)."""
        where: list[tuple[bool, int]] = []
        counts = [0, 0]
        for windowed in flags:
            where.append((windowed, counts[windowed]))
            counts[windowed] += 1
        full = allocate_kv_cache(mc, counts[0], num_blocks, block_size, dtype, device)
        window = None
        if num_window_blocks:
            window = allocate_kv_cache(mc, counts[1], num_window_blocks, block_size, dtype, device)
        return cls(full, window, tuple(where))

    def layer(self, local: int, md: AttentionMetadata) -> tuple[torch.Tensor, AttentionMetadata]:
        """Local layer `local`'s cache [2, blocks, block_size, kv_heads, head_dim] and the metadata
        of its group (`md` is the full group's, `md.window` the windowed group's)."""
        windowed, i = self.where[local]
        if windowed:
            assert self.window is not None and md.window is not None
            return self.window[i], md.window
        return self.full[i], md

    def tensors(self) -> list[torch.Tensor]:
        return [self.full] if self.window is None else [self.full, self.window]
