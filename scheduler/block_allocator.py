"""Accounting of paged KV blocks. The host decides which blocks each request uses; every stage
holds the same block ids for its own layers, so one decision here holds on every stage.

With prefix caching, a full block is also known by the hash of its contents (`block_hash`). A
block can then be held by several requests at once (a reference count), and a block that no
request holds any more keeps its contents until the space is needed: it is *cached*, and taken
back least-recently-used first. Every block is in exactly one of three states:

    free    holds nothing anyone can find (ref 0, no hash)
    cached  holds a known prefix that nobody uses now (ref 0, hashed, in the LRU order)
    used    held by one or more requests (ref > 0, hashed or not)

`num_free` counts free and cached blocks alike: both can be allocated, the cached ones by
evicting them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


class OutOfBlocks(RuntimeError):
    pass


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The identity of a full block: its tokens, chained over the block before it (so equal
    tokens at different places, or after different prefixes, differ). 128 bits of BLAKE2: a
    collision would silently serve another prefix's KV, so not Python's 64-bit `hash`. Nothing
    else changes a block's contents here: the model, dtype and block size are fixed per cache.
    The first block's parent is None, or `salt_root(cache_salt)` for a salted request."""
    h = hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16)
    if parent is not None:
        h.update(parent)
    return h.digest()


def salt_root(cache_salt: str) -> bytes:
    """The parent of a salted request's first block, so that every block of its chain differs
    from those of any other salt, and of no salt (whose first block hashes fewer bytes). Its own
    personalization makes it a different function from `block_hash`: a salt cannot be chosen to
    equal some other prompt's chain hash and so continue that chain. Encoded with
    "surrogatepass", so that any JSON string (lone surrogates too) is a salt, not a crash."""
    data = cache_salt.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=16, person=b"ppserve.salt").digest()


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Blocks [_fresh, num_blocks) were never handed out: free, and in no list yet, so that the
        # bookkeeping grows with the blocks used, not with the pool (a pool whose layers hold no
        # KV, the full-attention group of a model whose every layer has a window, is large:
        # kv_groups.py). They are handed out after the free list, lowest first.
        self._fresh = 0
        # LIFO free list: recently freed blocks are reused first (warm in cache).
        self._free: list[int] = []
        self._refs: list[int] = []  # per block handed out so far
        self._hash: list[bytes | None] = []  # content of a registered block
        self._by_hash: dict[bytes, int] = {}  # registered blocks, used or cached
        self._salt: list[str | None] = []  # the cache salt of a registered block's request
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently used first
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated: free ones, and cached ones (by evicting them)."""
        return self.num_empty + len(self._lru)

    @property
    def num_empty(self) -> int:
        """Free blocks that hold nothing cached: allocating them evicts nothing."""
        return len(self._free) + self.num_blocks - self._fresh

    @property
    def num_cached(self) -> int:
        """Blocks whose contents can be found by hash (used or not)."""
        return len(self._by_hash)

    @property
    def num_evictable(self) -> int:
        """Cached blocks nobody uses: kept until the space is needed."""
        return len(self._lru)

    def ref_count(self, block: int) -> int:
        return self._refs[block] if 0 <= block < self._fresh else 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """n blocks for new contents: free ones first, then the least recently used cached ones.

        In ascending order: blocks taken together then mostly lie one after the other in memory,
        which the CPU decode kernel reads faster than scattered or reversed blocks
        (docs/benchmarks.md#prefix-caching). Eviction goes tail first (see `free`), which
        alone would hand out an old request's blocks backwards."""
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} KV blocks, {self.num_free} free")
        keep = max(0, len(self._free) - n)
        taken = self._free[keep:][::-1]
        del self._free[keep:]
        fresh = min(n - len(taken), self.num_blocks - self._fresh)
        if fresh > 0:
            taken += range(self._fresh, self._fresh + fresh)
            self._fresh += fresh
            self._refs += [0] * fresh
            self._hash += [None] * fresh
            self._salt += [None] * fresh
        while len(taken) < n:
            block, _ = self._lru.popitem(last=False)
            self._unregister(block)
            self.num_evictions += 1
            taken.append(block)
        taken.sort()
        for b in taken:
            self._refs[b] = 1
        return taken

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Extend `table` in place so it covers `num_tokens` tokens."""
        missing = self.blocks_for(num_tokens) - len(table)
        if missing > 0:
            table.extend(self.allocate(missing))

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block. The last one makes a registered block cached, an
        unregistered one free. Tail blocks go first, so they are evicted before the prefix that
        leads to them (which more requests share)."""
        for b in reversed(blocks):
            if self.ref_count(b) <= 0:
                raise ValueError(f"KV block {b} freed more often than it was taken")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self._hash[b] is not None:
                    self._lru[b] = None
                else:
                    self._free.append(b)

    # ---- prefix caching -------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks holding the longest cached prefix of `hashes` (not taken yet: see `take`)."""
        hits: list[int] = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def find(self, h: bytes) -> int | None:
        """The block holding the contents `h` (used or cached), if any (not taken yet)."""
        return self._by_hash.get(h)

    def take(self, blocks: Sequence[int]) -> None:
        """One more reference to each of these (cached or used) blocks."""
        for b in blocks:
            if self.ref_count(b) == 0:
                if b not in self._lru:
                    raise ValueError(f"KV block {b} is free: only cached or used blocks can be shared")
                del self._lru[b]
            self._refs[b] += 1

    def register(self, block: int, h: bytes, salt: str | None = None) -> None:
        """`block` (used, full) holds the contents `h`, findable by later requests; `salt`: its
        request's cache salt (for `flush`). If another block holds them already (two requests
        computed the same prefix at once), that one stays the cached copy and this one is freed
        as usual when its request ends."""
        if not self.enable_caching or h in self._by_hash or self._hash[block] is not None:
            return
        self._hash[block] = h
        self._by_hash[h] = block
        self._salt[block] = salt

    def flush(self, salt_prefix: str | None = None) -> int:
        """Forget cached prefixes: cached blocks become free, and blocks in use are no longer
        found by later requests. Every prefix, or (`salt_prefix`) only those of requests whose
        cache salt starts with it (a tenant's). Returns how many cached blocks became free."""
        chosen = [
            b
            for b in self._by_hash.values()
            if salt_prefix is None or ((s := self._salt[b]) is not None and s.startswith(salt_prefix))
        ]
        dropped = 0
        for block in chosen:
            self._unregister(block)
            if block in self._lru:
                del self._lru[block]
                self._free.append(block)
                dropped += 1
        return dropped

    def _unregister(self, block: int) -> None:
        h = self._hash[block]
        if h is not None:
            del self._by_hash[h]
            self._hash[block] = None
            self._salt[block] = None
