"""A request's KV blocks in each group of layers, as the scheduler accounts for them.

Every model has the full-attention group: `full`, the allocator whose blocks `Request.block_table`
holds (the scheduler's `allocator`). A model with sliding-window layers has the windowed group too
(window_kv.py), whose blocks slide out and are freed as a request goes on. Its table has as many
entries as the full one, so a chunk needs as many new blocks in each; the windowed group has
them back sooner. Admission, preemption and steps planned ahead check both pools.

A model whose every layer has a window (Mistral) still has the full group, of no layers: its
blocks hold no KV on any stage, only the identity of a request's positions (what prefix caching
finds by hash), and its pool is sized so as never to be the one that runs out (engine/config.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ppserve.scheduler.block_allocator import BlockAllocator
from ppserve.scheduler.request import Request
from ppserve.scheduler.window_kv import FREED, WindowKv, blocks_per_request


@dataclass(frozen=True)
class CachedPrefix:
    """What a new request can start from: its first len(blocks) blocks, cached."""

    blocks: list[int] = field(default_factory=list)  # the full-attention group's, from block 0
    window: list[int] = field(default_factory=list)  # the windowed group's table for them (FREED below its window)


class KvSettings(Protocol):
    """The scheduler's settings that size the groups (SchedulerConfig's fields)."""

    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def kv_window(self) -> int | None: ...
    @property
    def num_window_blocks(self) -> int: ...
    @property
    def chunked_prefill_size(self) -> int: ...


class KvGroups:
    def __init__(self, config: KvSettings) -> None:
        bs, caching = config.block_size, config.enable_prefix_caching
        self.block_size = bs
        self.full = BlockAllocator(config.num_blocks, bs, caching)
        self.window: WindowKv | None = None
        self.per_request = 0  # the most blocks a request holds in the windowed group
        if config.kv_window is not None:
            self.window = WindowKv(config.kv_window, config.num_window_blocks, bs, caching)
            self.per_request = blocks_per_request(config.kv_window, config.chunked_prefill_size, bs)

    @property
    def max_tokens(self) -> int:
        """A prompt must be shorter than this to fit the cache on its own (with nothing else)."""
        tokens = self.full.num_blocks * self.block_size
        if self.window is not None and self.window.allocator.num_blocks < self.per_request:
            tokens = min(tokens, self.window.allocator.num_blocks * self.block_size)
        return tokens

    def has_free(self, need: int) -> bool:
        """Whether `need` new blocks can be had in every group (evicting cached ones if need be)."""
        return need <= self.full.num_free and (self.window is None or need <= self.window.allocator.num_free)

    def needs_more_than_empty(self, r: Request, num_tokens: int) -> bool:
        """Whether covering `num_tokens` tokens of r takes more blocks than are empty (so that
        it would evict or preempt) in some group. Without what r's window would free: a bound."""
        need = self.full.blocks_for(num_tokens) - len(r.block_table)
        return need > self.full.num_empty or (self.window is not None and need > self.window.allocator.num_empty)

    def admissible(self, hit: CachedPrefix, num_tokens: int) -> bool:
        """Whether a request starting from `hit` finds blocks for its first `num_tokens` tokens
        without preempting anyone. Taking a cached block that nobody uses removes it from what
        can be allocated."""
        full = self.full
        need = full.blocks_for(num_tokens) - len(hit.blocks)
        if need > full.num_free - sum(1 for b in hit.blocks if full.ref_count(b) == 0):
            return False
        w = self.window
        return w is None or need <= w.allocator.num_free - w.num_unused(hit.window)

    def admit(self, r: Request, hit: CachedPrefix) -> None:
        """r (holding nothing) starts from `hit`: it takes the cached blocks of each group."""
        self.full.take(hit.blocks)
        r.block_table.extend(hit.blocks)
        if self.window is not None:
            self.window.extend(r, [b for b in hit.window if b != FREED], len(hit.window))

    def slide(self, r: Request) -> None:
        """Free r's windowed blocks below the window of its next chunk."""
        if self.window is not None:
            self.window.slide(r)

    def grow(self, r: Request, num_tokens: int) -> None:
        """r's tables cover `num_tokens` tokens (`has_free` said the blocks are there)."""
        self.full.grow(r.block_table, num_tokens)
        if self.window is not None:
            self.window.grow(r)

    def shrink(self, r: Request, num_tokens: int) -> None:
        """r's tables cover only `num_tokens` tokens: the blocks past them go back (they were taken
        for drafts that were rejected, so nothing was registered in them)."""
        keep = self.full.blocks_for(num_tokens)
        if len(r.block_table) > keep:
            self.full.free(r.block_table[keep:])
            del r.block_table[keep:]
            if self.window is not None:
                self.window.shrink(r, keep)

    def free(self, r: Request) -> None:
        self.full.free(r.block_table)
        r.block_table.clear()
        if self.window is not None:
            self.window.free(r)

    def flush(self, salt_prefix: str | None = None) -> int:
        """Forget cached prefixes (every one, or a tenant's) in every group; how many cached
        blocks became free."""
        dropped = self.full.flush(salt_prefix)
        if self.window is not None:
            dropped += self.window.allocator.flush(salt_prefix)
        return dropped
