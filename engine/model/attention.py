"""Attention over a paged KV cache, for a flat batch of requests of different lengths.

A batch is a flat list of new tokens (`num_tokens` rows), grouped by request. Each request
contributes `num_new` tokens starting at position `start`, so its queries see keys
[0, start + i] (and only the last `window` of those on sliding-window layers). One decode token is
the case num_new == 1; a prefill chunk after an existing prefix is the general case; nothing here
knows the difference except for batching.

This module holds what a step builds once for every layer (`AttentionMetadata`: the batch's
prefill groups and decode group, their block tables and masks, the gather buffers); the attention
itself is an `AttentionBackend`'s (engine/model/attention_backend.py), chosen once per stage.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch

from ppserve.scheduler.window_kv import first_window_block


class SeqSpan(Protocol):
    """One request's share of a batch, as the attention needs it."""

    @property
    def start(self) -> int: ...  # position of the first new token (= tokens already in the KV cache)

    @property
    def num_new(self) -> int: ...  # new tokens this step

    @property
    def block_table(self) -> Sequence[int]: ...  # KV blocks holding positions [0, start + num_new)


@dataclass(frozen=True)
class PrefillGroup:
    rows: slice  # this request's rows in the flat batch
    block_ids: torch.Tensor  # [num_blocks_needed] long
    context_len: int  # start + num_new
    masks: dict[int | None, torch.Tensor | None]  # per window: [num_new, context_len] bool; None = causal


@dataclass(frozen=True)
class DecodeGroup:
    # Each request's single row in the flat batch: a slice when they are contiguous (an all-decode
    # batch, or decodes planned first), which saves a gather and a scatter per layer.
    rows: slice | torch.Tensor
    block_tables: torch.Tensor  # [num_decodes, max_blocks] long, padded with block 0
    context_lens: torch.Tensor  # [num_decodes] long: keys each query sees (its position + 1)
    block_size: int
    # Per window: [num_decodes, 1, 1, max_blocks * block_size] bool. Made on first use, once per
    # step: only the padded SDPA path reads them, and they grow with the batch's whole context.
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor:
        if (m := self.masks.get(window)) is None:
            num_keys = self.block_tables.shape[1] * self.block_size
            m = self.masks[window] = _mask(self.context_lens - 1, num_keys, window)[:, None, None, :]
        return m


class GatherBuffers:
    """Reusable destination of the per-layer KV gathers, grown on demand and kept.

    A gather of a large batch is several MB; allocating it afresh for every layer of every step
    goes to mmap/munmap and page faults, which cost more than the copy itself on CPU.
    """

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor | None] = [None, None]  # keys, values

    def gather(self, which: int, cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """cache[blocks] ([n, block_size, kv_heads, head_dim]) into buffer `which` (0 keys, 1 values)."""
        shape = (blocks.numel(), *cache.shape[1:])
        buf = self._bufs[which]
        if buf is None or buf.numel() < math.prod(shape) or buf.dtype != cache.dtype or buf.device != cache.device:
            buf = torch.empty(math.prod(shape), dtype=cache.dtype, device=cache.device)
            self._bufs[which] = buf
        out = buf[: math.prod(shape)].view(shape)
        return torch.index_select(cache, 0, blocks, out=out)


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about a batch; built once per step, shared by all layers."""

    positions: torch.Tensor  # [num_tokens] long: each new token's position in its sequence
    slot_mapping: torch.Tensor  # [num_tokens] long: flat cache slot (block * block_size + offset)
    decode: DecodeGroup | None
    prefills: tuple[PrefillGroup, ...]
    buffers: GatherBuffers
    # The sliding-window layers' own group (scheduler/window_kv.py), where the stage has one: the
    # same spans over that group's blocks (see `with_window`); the full-attention layers read this one.
    window: AttentionMetadata | None = None

    @classmethod
    def build(
        cls,
        spans: Sequence[SeqSpan],
        block_size: int,
        device: torch.device,
        windows: Iterable[int | None] = (None,),
        buffers: GatherBuffers | None = None,
    ) -> AttentionMetadata:
        """From spans that each carry their whole block table (see `from_tables`)."""
        tables, lengths = padded_tables([s.block_table for s in spans])
        starts, num_new = [s.start for s in spans], [s.num_new for s in spans]
        return cls.from_tables(starts, num_new, tables, lengths, block_size, device, windows, buffers)

    @classmethod
    def from_tables(
        cls,
        starts: Sequence[int],
        num_new: Sequence[int],
        tables: torch.Tensor,
        lengths: Sequence[int],
        block_size: int,
        device: torch.device,
        windows: Iterable[int | None] = (None,),
        buffers: GatherBuffers | None = None,
    ) -> AttentionMetadata:
        """Span i has num_new[i] new tokens from position starts[i]; its KV blocks are the first
        lengths[i] entries of tables[i] (tables: [batch, width] long on the CPU, zero padded).
        `windows`: the sliding windows of the layers that will use this metadata (masks are built
        once here rather than once per layer).

        Python work is per span, never per token or per block: positions and slots are array ops
        (numpy on the CPU's table: a few microseconds each, where a small batch would pay more
        in torch's per-op overhead than the old per-token loop cost), moved to `device` at the end.
        """
        windows = tuple(set(windows))
        batch = len(starts)
        needed: list[int] = []  # blocks each span reads: those holding positions [0, start + num_new)
        for start, n, length in zip(starts, num_new, lengths, strict=True):
            if n < 1:
                raise ValueError("a chunk must carry at least one new token")
            needed.append(-(-(start + n) // block_size))
            if length < needed[-1]:
                raise ValueError(f"block table has {length} blocks, {start + n} tokens need {needed[-1]}")
        table = tables.numpy()  # [batch, width] int64, shares memory
        start_a = np.asarray(starts, dtype=np.int64)  # [batch]
        new_a = np.asarray(num_new, dtype=np.int64)  # [batch]
        span_of = np.repeat(np.arange(batch), new_a)  # [num_tokens]: each row's span
        first_row = np.cumsum(new_a) - new_a  # [batch]: each span's first row
        positions = start_a[span_of] + np.arange(len(span_of)) - first_row[span_of]  # [num_tokens]
        # slot = block * block_size + offset, the block read from the row's own table.
        slots = table[span_of, positions // block_size] * block_size + positions % block_size  # [num_tokens]

        prefills: list[PrefillGroup] = []
        decode_spans: list[int] = []
        row = 0
        for i in range(batch):
            start, n = starts[i], num_new[i]
            if n == 1:
                decode_spans.append(i)
            else:
                end = start + n
                q_pos = torch.arange(start, end, device=device)
                prefills.append(
                    PrefillGroup(
                        rows=slice(row, row + n),
                        block_ids=tables[i, : needed[i]].to(device),
                        context_len=end,
                        # A fresh prompt without a window is plain causal: SDPA's is_causal is faster.
                        masks={w: None if start == 0 and w is None else _mask(q_pos, end, w) for w in windows},
                    )
                )
            row += n
        decode = None
        if decode_spans:
            index = np.asarray(decode_spans, dtype=np.int64)  # [num_decodes]
            need = np.asarray([needed[i] for i in decode_spans], dtype=np.int64)  # [num_decodes]
            width = int(need.max())
            block_tables = table[index, :width]  # [num_decodes, width], a copy
            # Entries past a span's own blocks read as block 0 (masked out either way).
            block_tables[np.arange(width) >= need[:, None]] = 0
            q_pos = torch.from_numpy(start_a[index]).to(device)
            decode = DecodeGroup(
                rows=_rows(first_row[index].tolist(), device),
                block_tables=torch.from_numpy(block_tables).to(device),
                context_lens=q_pos + 1,
                block_size=block_size,
            )
        return cls(
            positions=torch.from_numpy(positions).to(device),
            slot_mapping=torch.from_numpy(slots).to(device),
            decode=decode,
            prefills=tuple(prefills),
            buffers=buffers or GatherBuffers(),
        )

    def with_window(
        self, tables: torch.Tensor, lengths: Sequence[int], starts: Sequence[int], num_new: Sequence[int],
        block_size: int, window: int, windows: Iterable[int | None],
    ) -> AttentionMetadata:  # fmt: skip
        """This metadata with that of the windowed group (`window`: the group's window, `windows`:
        its layers'), whose tables are `tables` and `lengths` as `from_tables` takes them.

        Each span's table is read from the first block its window reaches (`first_window_block`)
        and its start counted from there: blocks below have slid out (their entries are stale ids
        or padding), and no attention path reads them, since every one of them depends only on
        the distance between a query and a key. Positions stay this metadata's own (RoPE's).
        """
        lo = np.asarray([first_window_block(s, window, block_size) for s in starts], dtype=np.int64)  # [batch]
        length = np.asarray(lengths, dtype=np.int64) - lo  # [batch]
        cols = lo[:, None] + np.arange(max(int(length.max(initial=0)), 1))  # [batch, width]
        table = tables.numpy()
        kept = np.take_along_axis(table, np.minimum(cols, table.shape[1] - 1), axis=1)  # [batch, width]
        kept[cols >= np.asarray(lengths)[:, None]] = 0
        shifted = [s - int(o) * block_size for s, o in zip(starts, lo, strict=True)]
        md = AttentionMetadata.from_tables(
            shifted, num_new, torch.from_numpy(kept), length.tolist(), block_size, self.positions.device,
            windows, self.buffers,
        )  # fmt: skip
        return replace(self, window=replace(md, positions=self.positions))


def padded_tables(tables: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[int]]:
    """Whole block tables as given (not kept by a stage): ([batch, width] long, zero padded; width
    at least 1) and their lengths."""
    lengths = [len(t) for t in tables]
    width = max(lengths, default=0) or 1
    out = torch.zeros((len(tables), width), dtype=torch.long)
    for i, t in enumerate(tables):
        if t:
            out[i, : len(t)] = torch.as_tensor(t, dtype=torch.long)
    return out, lengths


def _rows(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.long, device=device)


def _mask(q_pos: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """[..., num_q, num_keys] bool, True where a query at q_pos may attend key position k."""
    k_pos = torch.arange(num_keys, device=q_pos.device)
    allowed = k_pos <= q_pos[..., None]
    if window is not None:
        allowed &= k_pos > q_pos[..., None] - window
    return allowed


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
) -> None:
    """Store this step's keys/values. caches: [num_blocks, block_size, kv_heads, head_dim];
    k, v: [num_tokens, kv_heads, head_dim]."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, md.slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, md.slot_mapping, v)
