"""Accounting of paged KV blocks. The host decides which blocks each request uses; every stage
holds the same block ids for its own layers."""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # LIFO free list: recently freed blocks are reused first (warm in cache).
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free")
        taken = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        return taken[::-1]

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Extend `table` in place so it covers `num_tokens` tokens."""
        missing = self.blocks_for(num_tokens) - len(table)
        if missing > 0:
            table.extend(self.allocate(missing))

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
