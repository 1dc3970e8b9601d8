"""The scheduler's two disaggregation roles: prefill keeps a finished request's KV until it is
sent; decode reserves blocks for KV computed elsewhere and decodes on from the first token."""

from __future__ import annotations

from scheduler_by_hand import complete, make, req

from ppserve.scheduler.request import FinishReason
from ppserve.scheduler.sampling_params import SamplingParams


def test_prefill_side_holds_the_kv_until_it_is_sent() -> None:
    s = make(blocks=8)
    r = req("p", 10, SamplingParams(max_tokens=1, temperature=0.0))
    r.hold_kv = True
    s.add(r)
    while (plan := s.schedule()) is not None:
        complete(s, plan, token=42)
    assert r.finished and r.output_token_ids == [42]
    assert r.block_table and s.allocator.num_free == 8 - 3  # 10 tokens in blocks of 4
    assert s.handover.held == {"p": r} and not s.has_work
    assert s.handover.release("p") and s.allocator.num_free == 8 and not r.block_table
    assert not s.handover.release("p")


def test_decode_side_reserves_blocks_then_decodes_from_the_first_token() -> None:
    s = make(blocks=8)
    r = req("d", 9, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    blocks = s.handover.reserve(r)
    assert blocks == r.block_table and len(blocks) == 3 and s.schedule() is None  # nothing to do yet
    assert s.handover.activate("d", 77) is r
    plan = s.schedule()
    assert plan is not None
    [chunk] = plan.chunks
    assert (chunk.start, chunk.token_ids, chunk.sample) == (9, [77], True)  # one decode step, no prefill
    assert plan.new_requests[0].output_token_ids == [77]  # penalties and seeded noise carry on
    complete(s, plan, token=5)
    while (plan := s.schedule()) is not None:
        complete(s, plan, token=6)
    assert r.output_token_ids == [77, 5, 6] and r.finish_reason == FinishReason.LENGTH
    assert s.allocator.num_free == 8


def test_decode_side_reservations_fail_cleanly() -> None:
    s = make(blocks=4)
    assert s.handover.reserve(req("big", 20)) is None and s.allocator.num_free == 4  # does not fit now
    done = req("one", 5, SamplingParams(max_tokens=1, temperature=0.0))
    s.handover.reserve(done)
    assert s.handover.activate("one", 3) is done and done.finished and s.allocator.num_free == 4  # max_tokens 1
    gone = req("gone", 5)
    s.handover.reserve(gone)
    assert s.abort("gone") is gone and s.allocator.num_free == 4  # aborted while its KV was coming
    assert s.handover.activate("gone", 3) is None
    s.handover.reserve(req("dead", 5))
    held = req("held", 5, SamplingParams(max_tokens=1, temperature=0.0))
    held.hold_kv = True
    s.add(held)
    plan = s.schedule()
    assert plan is not None
    complete(s, plan)
    assert s.allocator.num_free == 0
    ended = s.fail_all()
    assert [r.request_id for r in ended] == ["dead"] and s.allocator.num_free == 4 and not s.handover.held
