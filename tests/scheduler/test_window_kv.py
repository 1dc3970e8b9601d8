"""Sliding-window KV on its own (scheduler/window_kv.py): no model, no processes.

A windowed layer keeps only the blocks of its window, from a pool of its own; blocks that slide
out go back to that pool while plans that read them may still be in flight. `KvReplica` checks
that this is safe: it plays one stage (the real BlockTables and AttentionMetadata, plans run in
order), remembers which token prefix's KV each cache slot holds, and on every read checks that
each key a query sees holds its own request's KV for that position.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from ppserve.engine.model.attention import AttentionMetadata
from ppserve.engine.runtime.block_tables import BlockTables
from ppserve.scheduler.block_allocator import BlockAllocator
from ppserve.scheduler.request import Request
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.scheduler.scheduler import Scheduler, SchedulerConfig
from ppserve.scheduler.window_kv import FREED, blocks_per_request
from ppserve.transport.messages import Sampled, StepPlan, StepResult

CPU = torch.device("cpu")


def make(
    window: int, window_blocks: int, blocks: int = 4096, bs: int = 4, chunk: int = 8, **settings: Any
) -> Scheduler:
    config = SchedulerConfig(  # no drafts: the replica stages here write the known tokens only
        num_blocks=blocks, block_size=bs, pp_size=2, chunked_prefill_size=chunk, max_batched_tokens=4 * chunk,
        speculative="off",
    )  # fmt: skip
    return Scheduler(replace(config, kv_window=window, num_window_blocks=window_blocks, **settings))


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


class KvReplica:
    """One stage's KV cache as contents: slot -> the identity of the token prefix whose last
    token's KV it holds (the KV at a position follows from the tokens up to it)."""

    def __init__(self, s: Scheduler, requests: dict[str, Request]) -> None:
        self.s, self.requests = s, requests
        self.bs = s.config.block_size
        window = s.config.kv_window
        assert window is not None
        self.window: int = window
        self.tables, self.window_tables = BlockTables(), BlockTables(windowed=True)
        self.full: dict[int, int] = {}
        self.windowed: dict[int, int] = {}
        self._prefixes: dict[str, list[int]] = {}
        self.reads = 0

    def content(self, rid: str, pos: int) -> int:
        """Equal for two requests exactly where their tokens up to `pos` are equal."""
        chain = self._prefixes.setdefault(rid, [])
        r = self.requests[rid]
        for p in range(len(chain), pos + 1):
            chain.append(hash((chain[-1] if chain else None, r.token_slice(p, p + 1)[0])))
        return chain[pos]

    def clear(self) -> None:
        """A replaced stage: no tables, no KV."""
        self.tables.clear()
        self.window_tables.clear()
        self.full.clear()
        self.windowed.clear()

    def run(self, plan: StepPlan) -> None:
        self.tables.apply(plan)
        self.window_tables.apply(plan)
        ids = [c.request_id for c in plan.chunks]
        starts, num_new = [c.start for c in plan.chunks], [c.num_new for c in plan.chunks]
        md = AttentionMetadata.from_tables(starts, num_new, *self.tables.lookup(ids), self.bs, CPU, (None,))
        md = md.with_window(*self.window_tables.lookup(ids), starts, num_new, self.bs, self.window, (self.window,))
        assert md.window is not None and torch.equal(md.window.positions, md.positions)
        written = [self.content(c.request_id, c.start + i) for c in plan.chunks for i in range(c.num_new)]
        for store, m in ((self.full, md), (self.windowed, md.window)):
            for slot, content in zip(m.slot_mapping.tolist(), written, strict=True):
                store[slot] = content  # every layer writes the batch's KV before any attention reads
        self._check(plan, md, self.full, None)
        self._check(plan, md.window, self.windowed, self.window)

    def _check(self, plan: StepPlan, md: AttentionMetadata, store: dict[int, int], window: int | None) -> None:
        """Every key a query of the plan sees, read where this metadata says it is."""
        prefills, decodes = iter(md.prefills), 0
        for c in plan.chunks:
            if c.num_new > 1:
                g = next(prefills)
                blocks, context = g.block_ids.tolist(), g.context_len
            else:
                assert md.decode is not None
                d, i = md.decode, decodes
                decodes += 1
                blocks, context = d.block_tables[i].tolist(), int(d.context_lens[i])
            shift = c.start + c.num_new - context  # the span's positions, counted from its first block read
            lo = 0 if window is None else max(0, c.start - window + 1)
            for p in range(lo, c.start + c.num_new):
                j = p - shift
                assert j >= 0, f"{c.request_id}: key {p} lies below the blocks read"
                slot = blocks[j // self.bs] * self.bs + j % self.bs
                got = store.get(slot)
                assert got == self.content(c.request_id, p), f"{c.request_id}: key {p} (window {window}) overwritten"
                self.reads += 1


def check_books(s: Scheduler, requests: dict[str, Request]) -> None:
    """Every block's references are the live table entries that name it, in each group; and no
    request holds more than its window's worth in the windowed group."""
    window = s.kv.window
    assert window is not None
    for alloc, table in ((s.allocator, "block_table"), (window.allocator, "window_table")):
        held: dict[int, int] = {}
        for r in requests.values():
            assert len(r.window_table) == len(r.block_table)
            for b in getattr(r, table):
                if b != FREED:
                    held[b] = held.get(b, 0) + 1
        for b in range(alloc.num_blocks):
            assert alloc.ref_count(b) == held.get(b, 0), (table, b)
        assert alloc.num_free == alloc.num_blocks - len(held)
    for r in requests.values():
        assert all(b == FREED for b in r.window_table[: r.window_freed])
        assert sum(b != FREED for b in r.window_table) <= s.kv.per_request


class Pipeline:
    """Plans run in order on the replica, results fed back oldest first (with random tokens)."""

    def __init__(self, s: Scheduler, requests: dict[str, Request], seed: int = 0) -> None:
        self.s, self.requests = s, requests
        self.stage = KvReplica(s, requests)
        self.inflight: deque[StepPlan] = deque()
        self.rng = random.Random(seed)

    def reset(self) -> None:
        """A stage replaced: the plans in flight are void, the stages' state is gone."""
        self.inflight.clear()
        self.stage.clear()
        self.s.reset_pipeline()

    def run(self, script: Callable[[int], bool] = lambda step: False, each: Callable[[], None] = lambda: None) -> None:
        """Until nothing is left to do; `script(step)` before each step (True while it has events
        left), `each()` after each step is planned, and the books checked."""
        s, more = self.s, True
        for step in range(20_000):
            if more:
                more = script(step)
            while (plan := s.schedule()) is not None:
                self.inflight.append(plan)
            each()
            check_books(s, self.requests)
            if not self.inflight:
                if more:
                    continue
                break
            plan = self.inflight.popleft()
            self.stage.run(plan)
            samples = [Sampled(c.request_id, self.rng.randrange(6, 500)) for c in plan.chunks if c.sample]
            s.update(StepResult(plan.mb_id, samples, []))
        assert not s.has_work


@pytest.mark.parametrize("caching", [False, True])
def test_a_long_request_holds_its_window_only(caching: bool) -> None:
    """4,000 tokens with a window of 512 in blocks of 16, chunks of 512, two plans in flight: the
    windowed group never holds more than ceil(512 / 16) + a chunk's 32 blocks, the full group
    grows with the request as before, and blocks that slide out are free again."""
    bs, window, chunk = 16, 512, 512
    s = make(window, 200, blocks=300, bs=bs, chunk=chunk, enable_prefix_caching=caching)
    r = Request("long", [random.Random(1).randrange(6, 500) for _ in range(4000)], params(40))
    requests = {"long": r}
    s.add(r)
    wa, fa = s.kv.window.allocator if s.kv.window else None, s.allocator
    assert wa is not None
    most = -(-window // bs) + chunk // bs
    peak: list[int] = []

    def each() -> None:
        used = wa.num_blocks - wa.num_free
        assert used <= most
        assert used == sum(b != FREED for b in r.window_table)  # every other block is back in the pool
        if r.block_table:  # the full group: every block up to what is scheduled, as without a window
            assert fa.num_blocks - fa.num_free == len(r.block_table) == -(-r.num_scheduled_tokens // bs)
        peak.append(used)

    pipe = Pipeline(s, requests)
    pipe.run(each=each)
    assert max(peak) == most and r.num_tokens == 4040 and pipe.stage.reads > 0
    assert wa.num_free == wa.num_blocks and fa.num_free == fa.num_blocks  # nothing leaked
    assert s.kv.per_request == most + 1  # a chunk that starts mid-block may span one more


@pytest.mark.parametrize(("pp", "window"), [(1, 5), (2, 12), (3, 7)])
def test_freed_blocks_serve_other_requests_while_plans_are_in_flight(pp: int, window: int) -> None:
    """A pool far smaller than what the requests' contexts take, shared by requests that come
    and go (consecutive chunks of long prompts, decodes, a step planned ahead at PP=1): every key
    every query reads is its own."""
    pool = 4 * blocks_per_request(window, 8, 4)
    s = make(window, pool, pp_size=pp, async_depth=1)
    rng = random.Random(window)
    requests: dict[str, Request] = {}

    def script(step: int) -> bool:
        if step < 40 and step % 3 == 0:
            rid = f"r{step}"
            requests[rid] = Request(rid, [rng.randrange(6, 500) for _ in range(rng.randrange(1, 60))], params(12))
            s.add(requests[rid])
        return step < 40

    pipe = Pipeline(s, requests, window)
    pipe.run(script)
    assert pipe.stage.reads > 1000 and s.kv.window is not None
    assert sum(-(-r.num_tokens // 4) for r in requests.values()) > 5 * pool  # blocks were reused, many times
    assert s.kv.window.allocator.num_free == s.kv.window.allocator.num_blocks
    assert s.allocator.num_free == s.allocator.num_blocks


@pytest.mark.parametrize(("seed", "tight"), [(0, "window"), (1, "full"), (2, "both")])
def test_no_block_leaks_after_aborts_preemptions_and_resets(seed: int, tight: str) -> None:
    """Tight pools (in one group or both: requests are preempted), shared prefixes (prefix
    caching), aborts mid-prompt and mid-answer, a pipeline reset: the books balance at every step
    and every block is back at the end."""
    rng = random.Random(seed)
    window = 10
    per = blocks_per_request(window, 8, 4)
    s = make(window, 2 * per if tight != "full" else 64, blocks=24 if tight != "window" else 256)
    requests: dict[str, Request] = {}
    pipe = Pipeline(s, requests, seed)
    base = [rng.randrange(6, 500) for _ in range(40)]

    def script(step: int) -> bool:
        if step < 60 and step % 4 == 0:
            rid = f"r{step}"
            prompt = base[: rng.randrange(1, 40)] + [rng.randrange(6, 500) for _ in range(rng.randrange(0, 12))]
            requests[rid] = Request(rid, prompt, params(rng.randrange(1, 10)))
            s.add(requests[rid])
        if step % 7 == 3 and requests:
            s.abort(rng.choice(list(requests)))
        if step == 30:
            pipe.reset()
        return step < 60

    pipe.run(script)
    assert s.num_preemptions > 0 and s.prefix_hits > 0
    assert s.kv.window is not None and s.kv.window.allocator.num_free == s.kv.window.allocator.num_blocks
    assert s.allocator.num_free == s.allocator.num_blocks
    assert all(not r.window_table and not r.block_table for r in requests.values())


def test_a_prefix_hit_needs_the_window_before_it() -> None:
    """A cached prefix of n tokens is usable only where the windowed group still holds the blocks
    of (n - w, n); otherwise the hit is cut back to where it does, or dropped."""
    window, bs = 8, 4
    s = make(window, 64, blocks=64, bs=bs, enable_prefix_caching=True)
    rng = random.Random(3)
    shared = [rng.randrange(6, 500) for _ in range(40)]
    requests = {"a": Request("a", [*shared, 7, 8], params(2))}
    s.add(requests["a"])
    Pipeline(s, requests).run()
    wa = s.kv.window
    assert wa is not None and wa.allocator.num_evictable > 0  # a's blocks stay cached, slid out or not
    hit = s.cache.cached_prefix(Request("b", [*shared, 9], params(1)))
    assert len(hit.blocks) == 10 and hit.window[:8] == [FREED] * 8 and FREED not in hit.window[8:]

    # c takes the cached blocks of its own shorter prefix; then every other cached windowed block
    # is evicted (the pool's blocks all allocated): b can start from c's prefix only.
    requests["c"] = Request("c", [*shared[:20], 5], params(30))
    s.add(requests["c"])
    plan = s.schedule()
    assert plan is not None and plan.chunks[0].start == 20
    taken = wa.allocator.allocate(wa.allocator.num_free)
    hit = s.cache.cached_prefix(Request("b", [*shared, 9], params(1)))
    assert len(hit.blocks) == 5 and hit.window == [FREED] * 3 + requests["c"].window_table[3:5]
    wa.allocator.free(taken)
    s.abort("c")
    s.update(StepResult(plan.mb_id, [], []))  # c's blocks are cached now, the only ones: evicted too
    wa.allocator.allocate(wa.allocator.num_free)
    assert s.cache.cached_prefix(Request("b", [*shared, 9], params(1))).blocks == []


def test_lazy_allocator_hands_out_blocks_as_before() -> None:
    """The pool's bookkeeping grows with the blocks handed out (a pool of no layers is large), in
    the order a list of every block gave: freed blocks first, then new ones, lowest first."""
    a = BlockAllocator(1 << 40, 4)
    assert a.allocate(3) == [0, 1, 2] and a.num_free == (1 << 40) - 3
    a.free([1])
    assert a.allocate(2) == [1, 3] and a.ref_count(7) == 0 and a.ref_count(3) == 1
    with pytest.raises(ValueError):
        a.free([9])


@pytest.mark.parametrize("head_dim", [16, 64])  # 64: the prefill kernel's, where it is built
@pytest.mark.parametrize("decode_kernel", [True, False])
def test_attention_reads_the_window_blocks_only(head_dim: int, decode_kernel: bool) -> None:
    """Attention over each span's window blocks, positions counted from the first of them (the
    windowed group's metadata), equals attention over the whole table; the blocks below the
    windows hold NaN, so a path that read them, even masked out, would show it."""
    from ppserve.engine.model import attention
    from ppserve.engine.model.attention_choice import choose_attention
    from ppserve.engine.model.attention_sdpa import SdpaAttention

    backend = choose_attention(CPU, torch.float32, head_dim) if decode_kernel else SdpaAttention()
    bs, window, kv_heads = 4, 10, 2
    spans = [(0, 13), (17, 1), (23, 6), (40, 1), (9, 1), (31, 9), (3, 1)]  # (start, new tokens)
    starts, num_new = [s for s, _ in spans], [n for _, n in spans]
    tables, next_block = [], 1  # block 0 stays finite: padding reads it
    for start, n in spans:
        need = -(-(start + n) // bs)
        tables.append(list(range(next_block, next_block + need)))
        next_block += need
    g = torch.Generator().manual_seed(head_dim)
    k_cache, v_cache = (torch.randn(next_block, bs, kv_heads, head_dim, generator=g) for _ in range(2))
    q = torch.randn(sum(num_new), 2 * kv_heads, head_dim, generator=g)
    padded, lengths = attention.padded_tables(tables)
    md = AttentionMetadata.from_tables(starts, num_new, padded, lengths, bs, CPU, (window,))
    whole = backend.forward(q, k_cache, v_cache, md, head_dim**-0.5, window)
    md = md.with_window(padded, lengths, starts, num_new, bs, window, (window,))
    assert md.window is not None
    for table, start in zip(tables, starts, strict=True):
        below = table[: max(0, start - window + 1) // bs]
        k_cache[below] = v_cache[below] = float("nan")
    windowed = backend.forward(q, k_cache, v_cache, md.window, head_dim**-0.5, window)
    torch.testing.assert_close(windowed, whole, rtol=1e-5, atol=1e-5)
