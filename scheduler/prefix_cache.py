"""Prefix caching for the scheduler: which of a request's blocks are cached, and which it fills.

A request starts from the longest run of full blocks whose contents are cached (shared by
reference; at least one token is always computed, to sample from), and skips ahead again
whenever another request has since filled the blocks it would compute next: requests that
arrive together with one system prompt take turns computing its chunks.

A block becomes findable as soon as the plan that fills it is built (one filled by a step planned
ahead, once `update` brings its token back): a later reader is in a later plan, which every stage
runs after this one, or in the same plan, where each layer writes the batch's KV before any
attention reads it. A pipeline that lost a stage's KV forgets every cached prefix.

Cache salt: a request's `cache_salt` (a tenant, or a client's own choice) roots the hash chain of
its blocks, so only requests with the same salt (or none) share cached prefixes.

Prompt logprobs: a request that asks for them computes its whole prompt, since a cached prefix
has no logits; it never starts from cached blocks (it still registers the blocks it fills, for
others).

Sliding windows: a model with windowed layers caches their blocks too, by the same hashes, in
their own group (window_kv.py). A prefix is usable only as far as that group still holds the
blocks of its last window; a hit is cut back to there.
"""

from __future__ import annotations

from ppserve.scheduler.block_allocator import BlockAllocator, block_hash, salt_root
from ppserve.scheduler.kv_groups import CachedPrefix
from ppserve.scheduler.request import Request
from ppserve.scheduler.window_kv import FREED, WindowKv


class PrefixCache:
    """The block hashes of requests, over the allocators' caches (a no-op where caching is off)."""

    def __init__(self, allocator: BlockAllocator, window: WindowKv | None = None) -> None:
        self.allocator = allocator
        self.window = window
        self.block_size = allocator.block_size
        self.enabled = allocator.enable_caching
        self.queries = 0  # tokens of admitted requests looked up
        self.hits = 0  # ... and found

    def cached_prefix(self, r: Request) -> CachedPrefix:
        """The cached blocks r can start from; the last token is never among them, so that
        there is something to compute and sample from."""
        if not self.enabled or r.params.prompt_logprobs is not None:
            return CachedPrefix()
        usable = (r.num_tokens - 1) // self.block_size
        self._hash_blocks(r, usable)
        hits = self.allocator.lookup(r.block_hashes[:usable])
        if self.window is None:
            return CachedPrefix(hits)
        k, found = self.window.cached(r.block_hashes, 0, len(hits))
        return CachedPrefix(hits[:k], [FREED] * (k - len(found)) + found)

    def admitted(self, r: Request, cached: int) -> None:
        """r starts running with its first `cached` tokens from the cache."""
        if r.num_cached_tokens is None:  # what the client is told: its first admission only
            r.num_cached_tokens = cached
        if self.enabled:
            self.queries += r.num_tokens
            self.hits += cached

    def skip_cached(self, r: Request) -> None:
        """A running request whose next blocks another request has filled since (in an earlier
        plan, or earlier in this one) takes them instead of computing them again."""
        if not self.enabled:
            return
        bs = self.block_size
        done = len(r.block_table)
        usable = (r.num_tokens - 1) // bs
        if r.num_scheduled_tokens != done * bs or usable <= done or r.params.prompt_logprobs is not None:
            return  # mid-block (its next tokens go into a block of its own), nothing to find, or it needs logits
        self._hash_blocks(r, usable)
        hits = self.allocator.lookup(r.block_hashes[done:usable])
        found: list[int] = []
        if self.window is not None:
            k, found = self.window.cached(r.block_hashes, done, done + len(hits))
            hits = hits[: k - done]
        if not hits:
            return
        self.allocator.take(hits)
        r.block_table.extend(hits)
        if self.window is not None:
            self.window.extend(r, found, len(hits))
        skipped = len(hits) * bs
        r.num_scheduled_tokens += skipped  # plans in flight still add theirs to num_computed_tokens
        r.num_computed_tokens += skipped
        self.hits += skipped
        if not r.output_token_ids and r.num_cached_tokens is not None:
            r.num_cached_tokens += skipped

    def filled(self, r: Request, n: int) -> None:
        """r's next n tokens go into a plan: the full blocks they complete become findable. A step
        planned ahead writes a token not known yet: `filled_ahead` registers its block."""
        if not self.enabled:
            return
        self._register(r, r.num_scheduled_tokens // self.block_size, min(r.num_scheduled_tokens + n, r.num_tokens))

    def filled_ahead(self, r: Request) -> None:
        """r's newest token is in a block a plan in flight (planned ahead) fills: if that token
        completes it, the block is findable from now on, as `filled` makes the others."""
        bs = self.block_size
        if self.enabled and r.num_tokens % bs == 0 and r.num_scheduled_tokens >= r.num_tokens:
            self._register(r, r.num_tokens // bs - 1, r.num_tokens)

    def verified(self, r: Request, known: int) -> None:
        """r's drafts were kept: blocks completed by tokens computed in its last step, which were
        not known when it was planned (`known` tokens were), are findable from now on."""
        if self.enabled:
            self._register(r, known // self.block_size, r.num_computed_tokens)

    def _register(self, r: Request, first: int, num_tokens: int) -> None:
        """r's blocks from `first` up to those its first `num_tokens` tokens fill are findable."""
        end = num_tokens // self.block_size
        self._hash_blocks(r, end)
        for i in range(first, end):
            self.allocator.register(r.block_table[i], r.block_hashes[i], r.cache_salt)
            if self.window is not None:
                self.window.register(r, i, r.block_hashes[i])

    def _hash_blocks(self, r: Request, num_blocks: int) -> None:
        """Extend r.block_hashes to its first `num_blocks` full blocks."""
        bs = self.block_size
        for i in range(len(r.block_hashes), num_blocks):
            # The salt roots the chain: requests of different salts (tenants) never find each
            # other's blocks, so cache hits and their timing say nothing across tenants.
            if i:
                parent: bytes | None = r.block_hashes[i - 1]
            else:
                parent = None if r.cache_salt is None else salt_root(r.cache_salt)
            r.block_hashes.append(block_hash(parent, r.token_slice(i * bs, (i + 1) * bs)))
