"""The prefix cache's bookkeeping, property-based: the block allocator on its own, and the
scheduler driven by random requests, plans completing in random order, aborts and a cache small
enough to evict and preempt. No processes, no model."""

from __future__ import annotations

import random
from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ppserve.scheduler.block_allocator import BlockAllocator, OutOfBlocks, block_hash
from ppserve.scheduler.request import Request
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.scheduler.scheduler import Scheduler, SchedulerConfig
from ppserve.transport.messages import Sampled, StepPlan, StepResult

NUM_BLOCKS = 12


class AllocatorMachine(RuleBasedStateMachine):
    """Holders stand for requests: each holds a list of blocks, one reference per entry."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BlockAllocator(NUM_BLOCKS, 4, enable_caching=True)
        self.holders: list[list[int]] = []
        self.contents: dict[int, bytes] = {}  # what each registered block was registered with

    def _held(self) -> Counter[int]:
        return Counter(b for blocks in self.holders for b in blocks)

    @rule(n=st.integers(1, 5))
    def allocate(self, n: int) -> None:
        held = set(self._held())
        if n > self.alloc.num_free:
            with pytest.raises(OutOfBlocks):
                self.alloc.allocate(n)
            return
        blocks = self.alloc.allocate(n)
        assert len(set(blocks)) == n
        assert not held & set(blocks), "a block in use was handed out again (evicted)"
        for b in blocks:  # new contents: an evicted block's old hash must be gone
            self.contents.pop(b, None)
        self.holders.append(blocks)

    @precondition(lambda self: self.holders)
    @rule(data=st.data(), token=st.integers(0, 6))
    def register(self, data: st.DataObject, token: int) -> None:
        blocks = data.draw(st.sampled_from(self.holders))
        block = data.draw(st.sampled_from(blocks))
        h = block_hash(None, [token])
        self.alloc.register(block, h)
        if block not in self.contents and self.alloc.lookup([h]) == [block]:
            self.contents[block] = h

    @rule(tokens=st.lists(st.integers(0, 6), min_size=1, max_size=3))
    def share(self, tokens: list[int]) -> None:
        hashes = [block_hash(None, [t]) for t in tokens]
        hits = self.alloc.lookup(hashes)
        assert len(hits) <= len(hashes)
        for b, h in zip(hits, hashes, strict=False):
            assert self.contents.get(b) == h, "a lookup found a block that holds other contents"
        if hits:
            self.alloc.take(hits)
            self.holders.append(hits)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.holders) - 1))
        self.alloc.free(self.holders.pop(i))

    @rule()
    def flush(self) -> None:
        self.alloc.flush()
        self.contents.clear()
        assert self.alloc.num_cached == 0 and self.alloc.num_evictable == 0

    @invariant()
    def accounting(self) -> None:
        held = self._held()
        for b in range(NUM_BLOCKS):
            assert self.alloc.ref_count(b) >= 0
            assert self.alloc.ref_count(b) == held[b], f"block {b}: ref count is not the number of holders"
        used = len(held)
        free = self.alloc.num_free - self.alloc.num_evictable
        assert free >= 0 and free + self.alloc.num_evictable + used == NUM_BLOCKS
        for b, h in self.contents.items():  # cached or used blocks are found by their contents
            assert self.alloc.lookup([h]) == [b]

    def teardown(self) -> None:
        for blocks in self.holders:
            self.alloc.free(blocks)
        assert self.alloc.num_free == NUM_BLOCKS, "something is not reclaimable after every holder left"
        assert all(self.alloc.ref_count(b) == 0 for b in range(NUM_BLOCKS))


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_double_free_and_sharing_a_free_block_are_refused() -> None:
    alloc = BlockAllocator(4, 4, enable_caching=True)
    (b,) = alloc.allocate(1)
    alloc.free([b])
    with pytest.raises(ValueError, match="freed more often"):
        alloc.free([b])
    with pytest.raises(ValueError, match="only cached or used blocks"):
        alloc.take([b])  # a free block holds nothing to share


def test_tail_blocks_are_evicted_before_the_prefix_they_extend() -> None:
    alloc = BlockAllocator(4, 4, enable_caching=True)
    table = alloc.allocate(3)
    chain: list[bytes] = []
    for i, b in enumerate(table):
        chain.append(block_hash(chain[-1] if chain else None, [i]))
        alloc.register(b, chain[-1])
    alloc.free(table)
    assert alloc.num_evictable == 3 and alloc.num_free == 4 and alloc.lookup(chain) == table
    taken = alloc.allocate(2)  # the free block, then the least recently used cached one: the tail
    assert table[2] in taken and alloc.num_evictions == 1
    assert alloc.lookup(chain) == table[:2]  # the prefix is still there


# ---- the scheduler, with random requests sharing prefixes --------------------------------

BLOCK = 4


def _scheduler(num_blocks: int, pp: int) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=BLOCK,
            pp_size=pp,
            max_batched_tokens=32,
            chunked_prefill_size=8,
            enable_prefix_caching=True,
        )
    )


def _check_blocks(s: Scheduler) -> None:
    """Every reference is a live request's (or a plan's still writing it): ref counts add up."""
    held = Counter(b for r in s.requests.values() for b in r.block_table)
    for b in range(s.allocator.num_blocks):
        assert s.allocator.ref_count(b) == held[b]
    free = s.allocator.num_free - s.allocator.num_evictable
    assert free + s.allocator.num_evictable + len(held) == s.allocator.num_blocks


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(10, 40), pp=st.integers(1, 3))
def test_scheduler_references_add_up_and_everything_is_reclaimed(seed: int, num_blocks: int, pp: int) -> None:
    rng = random.Random(seed)
    s = _scheduler(num_blocks, pp)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 20))] for _ in range(3)]
    inflight: list[StepPlan] = []
    ids = iter(range(10_000))
    for _ in range(300):
        op = rng.random()
        if op < 0.25 and len(s.requests) < 8:
            base = rng.choice(prefixes)
            prompt = base[: rng.randrange(len(base) + 1)] + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            params = SamplingParams(max_tokens=rng.randrange(1, 8), ignore_eos=True)
            s.add(Request(f"r{next(ids)}", prompt[: num_blocks * BLOCK // 2], params))
        elif op < 0.3 and s.requests:
            s.abort(rng.choice(list(s.requests)))
        elif op < 0.33:
            s.flush_cache()
        while (plan := s.schedule()) is not None:
            inflight.append(plan)
        if inflight and rng.random() < 0.7:
            plan = inflight.pop(rng.randrange(len(inflight)))
            samples = [Sampled(c.request_id, rng.randrange(50)) for c in plan.chunks if c.sample]
            s.update(StepResult(plan.mb_id, samples, []))
        _check_blocks(s)
    for rid in list(s.requests):
        s.abort(rid)
    for plan in inflight:
        s.update(StepResult(plan.mb_id, [], []))
    assert not s.requests and s.allocator.num_free == num_blocks
    s.flush_cache()
    assert s.allocator.num_cached == 0


# ---- the scheduler's decisions, case by case ---------------------------------------------


def _drain(s: Scheduler) -> list[StepPlan]:
    """Run to completion, plans answered oldest first (as the stages do)."""
    plans: list[StepPlan] = []
    inflight: list[StepPlan] = []
    for _ in range(1000):
        while (plan := s.schedule()) is not None:
            plans.append(plan)
            inflight.append(plan)
        if not inflight:
            return plans
        plan = inflight.pop(0)
        s.update(StepResult(plan.mb_id, [Sampled(c.request_id, 7) for c in plan.chunks if c.sample], []))
    raise AssertionError("did not finish")


def _req(rid: str, prompt: list[int], max_tokens: int = 2) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_a_repeated_prompt_computes_only_what_is_not_cached() -> None:
    s = _scheduler(32, pp=1)
    prompt = list(range(100, 116))  # four full blocks
    s.add(_req("a", prompt))
    _drain(s)
    s.add(b := _req("b", prompt))
    (first, *_) = _drain(s)
    # The last block is computed again: something must be, to sample from.
    assert [(c.start, c.num_new) for c in first.chunks] == [(12, 4)] and b.num_cached_tokens == 12
    s.add(c := _req("c", [*prompt[:9], 1, 2, 3]))
    (first, *_) = _drain(s)
    assert [(ch.start, ch.num_new) for ch in first.chunks] == [(8, 4)] and c.num_cached_tokens == 8
    assert (s.prefix_hits, s.prefix_queries) == (20, 16 + 16 + 12)


def test_choices_admitted_together_share_the_prompt() -> None:
    s = _scheduler(32, pp=1)
    choices = [_req(f"n{i}", list(range(50, 70))) for i in range(3)]
    for r in choices:
        s.add(r)
    plan = s.schedule()
    assert plan is not None
    # Each choice starts where the one before it stops: the blocks it fills in this very plan are
    # written, layer by layer, before any attention reads them.
    assert [(c.start, c.num_new) for c in plan.chunks] == [(0, 8), (8, 8), (16, 4)]
    assert [r.num_cached_tokens for r in choices] == [0, 8, 16]


def test_requests_arriving_together_take_turns_on_a_shared_prompt() -> None:
    s = _scheduler(64, pp=2)
    prompt = list(range(200, 248))  # 12 blocks, 6 chunks
    for i in range(4):
        s.add(_req(f"r{i}", prompt))
    computed = Counter(pos for plan in _drain(s) for c in plan.chunks for pos in range(c.start, c.start + c.num_new))
    shared = range(len(prompt) - BLOCK)  # the blocks every request can take from the cache
    assert all(computed[pos] == 1 for pos in shared), "a cached position was computed twice"
    assert s.prefix_hits > 3 * len(shared) // 2


def test_eviction_comes_before_preemption() -> None:
    s = _scheduler(12, pp=1)
    s.add(_req("a", list(range(300, 332))))  # 8 blocks, cached when done
    _drain(s)
    assert s.allocator.num_evictable == 8
    s.add(_req("b", list(range(400, 420)), max_tokens=12))
    s.add(_req("c", list(range(500, 510))))
    _drain(s)  # 8 + 3 blocks fit in 12, but only 4 are free: the cached ones are evicted instead
    assert s.num_preemptions == 0 and s.allocator.num_evictions > 0


def test_a_pipeline_reset_forgets_every_cached_prefix() -> None:
    s = _scheduler(32, pp=2)
    prompt = list(range(100, 120))
    s.add(_req("a", prompt))
    _drain(s)
    assert s.allocator.num_cached == 5
    s.reset_pipeline()  # a stage was replaced: its KV is gone
    assert s.allocator.num_cached == 0
    s.add(b := _req("b", prompt))
    _drain(s)
    assert b.num_cached_tokens == 0


def test_without_caching_nothing_is_shared() -> None:
    s = Scheduler(
        SchedulerConfig(num_blocks=32, block_size=BLOCK, pp_size=1, chunked_prefill_size=8, enable_prefix_caching=False)
    )
    for rid in ("a", "b"):
        s.add(_req(rid, list(range(100, 120))))
        _drain(s)
    assert s.prefix_hits == s.prefix_queries == s.allocator.num_cached == 0
