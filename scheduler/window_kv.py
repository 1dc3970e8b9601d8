"""The windowed KV group: the blocks of a model's sliding-window layers, freed as they slide out.

A sliding-window layer's query at position p sees keys in (p - w, p] only (Mistral: every layer;
Gemma 3: five of every six). Its KV lives in a group of its own, with its own pool of blocks
(`allocator`) and its own table per request (`Request.window_table`), beside the full-attention
layers' group (the scheduler's allocator and `Request.block_table`). Entry i of either table covers
positions [i * bs, (i + 1) * bs); the two tables always have the same length, so a plan sends both
from `num_blocks_sent` on. What differs: a chunk that starts at s reads the windowed group's keys
from s - w + 1 on only, so when it is planned, the entries of blocks wholly below that go back to
the pool (`slide`) and read FREED. A request thus holds at most `blocks_per_request` blocks here,
however long it grows, while its full-attention table grows as before.

Why a block may be freed while plans that read it are still in flight: a request's later chunks
start later, and so read from a later block on (consecutive chunks of one prompt in flight at
once, a decode step planned ahead: all of them). Another request given the block writes it in the
plan being built or a later one, and every stage runs that plan after every earlier one, so each
stage's reads of the old contents (in earlier plans) are over before the new ones land. In the
same plan, the owner's chunk reads only from its own window on, above the block.

The stages keep stale ids in the entries that read FREED here (a table is only ever sent whole,
or extended): their attention reads each chunk's table from the chunk's first window block on
(`first_window_block`, engine/model/attention.py), so no stage ever reads an entry below it.

Prefix caching: a block's hash names its contents in either group (the KV of a layer at a position
follows from the tokens up to it). A request may start after n cached tokens only if the windowed
group still holds the blocks of (n - w, n) too (`cached`); otherwise the hit is cut back to where
it does. A block that slides out is cached here like any other (findable until evicted).
"""

from __future__ import annotations

from collections.abc import Sequence

from ppserve.scheduler.block_allocator import BlockAllocator
from ppserve.scheduler.request import Request

FREED = -1  # a window table's entry whose block slid out (or, from a cached prefix, was never taken)


def first_window_block(start: int, window: int, block_size: int) -> int:
    """The first block a chunk that starts at `start` reads: its first query sees keys from
    start - window + 1 on."""
    return max(0, start - window + 1) // block_size


def blocks_per_request(window: int, chunk: int, block_size: int) -> int:
    """The most blocks a request holds in the windowed group: those of positions
    [s - window + 1, s + chunk) for a chunk at s, which span at most one block more than their
    length does."""
    return -(-(window - 1 + chunk) // block_size) + 1


class WindowKv:
    def __init__(self, window: int, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        if window < 1:
            raise ValueError(f"a sliding window must be >= 1, got {window}")
        self.window = window
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks, block_size, enable_caching)

    def slide(self, r: Request, start: int | None = None) -> None:
        """Free r's blocks below the window of its chunk at `start` (by default its next one):
        no chunk of r from there on reads them."""
        s = r.num_scheduled_tokens if start is None else start
        end = min(first_window_block(s, self.window, self.block_size), len(r.window_table))
        if end <= r.window_freed:
            return
        table = r.window_table
        gone = [b for b in table[r.window_freed : end] if b != FREED]
        table[r.window_freed : end] = [FREED] * (end - r.window_freed)
        r.window_freed = end
        self.allocator.free(gone)

    def grow(self, r: Request) -> None:
        """Blocks for r's new entries, as many as its full-attention table has gained."""
        missing = len(r.block_table) - len(r.window_table)
        if missing > 0:
            r.window_table.extend(self.allocator.allocate(missing))

    def shrink(self, r: Request, keep: int) -> None:
        """r's entries from `keep` on go back (blocks taken for drafts that were rejected)."""
        self.allocator.free([b for b in r.window_table[max(keep, r.window_freed) :] if b != FREED])
        del r.window_table[keep:]
        r.window_freed = min(r.window_freed, keep)

    def free(self, r: Request) -> None:
        """r's blocks all go back (it ended, or was preempted)."""
        self.allocator.free([b for b in r.window_table[r.window_freed :] if b != FREED])
        r.window_table.clear()
        r.window_freed = 0

    def num_unused(self, table: Sequence[int]) -> int:
        """Blocks of `table` that nobody holds (cached ones, which taking them removes from the pool)."""
        return sum(1 for b in table if b != FREED and self.allocator.ref_count(b) == 0)

    # ---- prefix caching -------------------------------------------------------------------

    def cached(self, hashes: Sequence[bytes], done: int, end: int) -> tuple[int, list[int]]:
        """A request that has blocks [0, done) (their windowed entries as they are) and finds
        blocks [done, end) cached in the full-attention group: the furthest k <= end it can start
        from, with the cached blocks of this group for [max(done, first), k), `first` being the
        first block its chunk at k reads. k may be `done` (nothing usable)."""
        bs = self.block_size
        best, run_start = done, done  # run_start: the first of the present blocks up to i
        for i in range(done, end):
            if self.allocator.find(hashes[i]) is None:
                run_start = i + 1
                continue
            if max(done, first_window_block((i + 1) * bs, self.window, bs)) >= run_start:
                best = i + 1
        lo = max(done, first_window_block(best * bs, self.window, bs))
        found = [self.allocator.find(h) for h in hashes[lo:best]]
        return best, [b for b in found if b is not None]

    def extend(self, r: Request, found: list[int], count: int) -> None:
        """r's table gains `count` cached entries: FREED below its new window, then `found`
        (taken); what r held below that window is freed."""
        self.allocator.take(found)
        r.window_table += [FREED] * (count - len(found)) + found
        self.slide(r, len(r.window_table) * self.block_size)

    def register(self, r: Request, i: int, h: bytes) -> None:
        """r's entry i is full and its contents are `h` (a block that slid out already is not)."""
        block = r.window_table[i]
        if block != FREED:
            self.allocator.register(block, h, r.cache_salt)
