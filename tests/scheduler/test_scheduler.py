"""The scheduler on its own: no processes, results fed back by hand."""

from __future__ import annotations

import random
from typing import Any

import pytest
from scheduler_by_hand import GREEDY, complete, drain, make, req

from ppserve.scheduler.request import FinishReason, Request
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.scheduler.scheduler import Scheduler
from ppserve.transport.messages import Sampled, StepPlan, StepResult


def test_long_prompt_chunks_fill_the_pipeline() -> None:
    s = make(pp=3, chunk=8, async_depth=1)  # one plan in flight beyond one per stage
    s.add(req("long", 40))
    plans = []
    while (plan := s.schedule()) is not None:
        plans.append(plan)
    # depth = pp + 1 plans in flight, consecutive chunks of the one prompt, no sampling yet.
    assert len(plans) == 4
    assert [(c.start, c.num_new, c.sample) for p in plans for c in p.chunks] == [
        (0, 8, False),
        (8, 8, False),
        (16, 8, False),
        (24, 8, False),
    ]
    complete(s, plans[0])
    last = s.schedule()
    assert last is not None and [(c.start, c.num_new, c.sample) for c in last.chunks] == [(32, 8, True)]
    assert s.schedule() is None  # its next step needs the token


def test_a_request_is_in_at_most_one_sampling_plan() -> None:
    s = make(pp=2)
    for i in range(6):
        s.add(req(f"r{i}", 3))
    seen: dict[str, int] = {}
    inflight: list[StepPlan] = []
    for _ in range(200):
        while (plan := s.schedule()) is not None:
            inflight.append(plan)
            for c in plan.chunks:
                if c.sample:
                    assert seen.get(c.request_id, 0) == 0, "two sampling chunks in flight"
                    seen[c.request_id] = 1
        if not inflight:
            break
        plan = inflight.pop(0)
        for c in plan.chunks:
            if c.sample:
                seen[c.request_id] = 0
        complete(s, plan)
    assert not s.has_work


def test_decodes_spread_over_micro_batches() -> None:
    s = make(pp=2, running=64)
    for i in range(8):
        s.add(req(f"r{i}", 2))
    first, second = s.schedule(), s.schedule()
    assert first is not None and second is not None
    assert len(first.chunks) == 4 and len(second.chunks) == 4  # ceil(8 / pp) each


def test_token_budget_and_max_running() -> None:
    s = make(pp=1, budget=10, chunk=8, running=2)
    for i in range(4):
        s.add(req(f"r{i}", 20))
    plan = s.schedule()
    assert plan is not None
    assert sum(c.num_new for c in plan.chunks) <= 10
    assert len(s.running) <= 2


def test_finish_on_max_tokens_and_stop_ids_frees_blocks() -> None:
    s = make()
    s.add(req("a", 5, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)))
    s.add(Request("b", [1, 2], SamplingParams(max_tokens=50, temperature=0, stop_token_ids=(7,))))
    drain(s)
    assert s.allocator.num_free == s.allocator.num_blocks


def test_eos_and_length_reasons() -> None:
    s = make(pp=1)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0), eos_token_ids=(7,))
    b = Request("b", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), eos_token_ids=(7,))
    s.add(a)
    s.add(b)
    drain(s)
    assert (a.finish_reason, a.output_token_ids) == (FinishReason.STOP, [7])
    assert (b.finish_reason, len(b.output_token_ids)) == (FinishReason.LENGTH, 5)


def test_abort_in_flight_frees_blocks_only_after_the_plan_returns() -> None:
    s = make(pp=2)
    s.add(req("a", 30))
    plan = s.schedule()
    assert plan is not None
    used = s.allocator.num_blocks - s.allocator.num_free
    assert used > 0
    s.abort("a")
    # A stage may still be writing a's KV blocks: they must not be reused yet.
    assert s.allocator.num_free == s.allocator.num_blocks - used
    complete(s, plan)
    assert s.allocator.num_free == s.allocator.num_blocks
    next_plan = s.schedule()
    assert next_plan is None or "a" in next_plan.released


def test_abort_waiting_request() -> None:
    s = make(running=1)
    s.add(req("a", 3))
    s.add(req("b", 3))
    assert s.abort("b") is not None
    assert s.abort("b") is None  # twice is harmless
    drain(s)
    assert s.allocator.num_free == s.allocator.num_blocks


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    # 8 blocks of 4 tokens = 32 tokens; three requests that each grow to 16 tokens.
    s = make(pp=1, blocks=8, chunk=16)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    reqs = [Request(f"r{i}", list(range(100 * i, 100 * i + 6)), params) for i in range(3)]
    for r in reqs:
        s.add(r)
    plans = drain(s)
    assert s.num_preemptions > 0
    assert all(len(r.output_token_ids) == 10 and r.finish_reason == FinishReason.LENGTH for r in reqs)
    assert s.allocator.num_free == 8
    # A preempted request is recomputed from position 0 over its prompt and its tokens so far.
    restarts = [c for p in plans for c in p.chunks if c.start == 0]
    assert len(restarts) > 3


def test_random_interleavings_keep_invariants() -> None:
    rng = random.Random(0)
    for trial in range(20):
        s = make(pp=rng.choice([1, 2, 4]), blocks=rng.choice([16, 64]), chunk=rng.choice([1, 3, 8]), budget=16)
        reqs = [
            req(f"{trial}-{i}", rng.randint(1, 30), SamplingParams(max_tokens=rng.randint(1, 8), temperature=0))
            for i in range(rng.randint(1, 12))
        ]
        for r in reqs:
            s.add(r)
        for r in rng.sample(reqs, k=len(reqs) // 4):
            s.abort(r.request_id)
        drain(s, rng)
        assert s.allocator.num_free == s.allocator.num_blocks
        assert all(r.finished for r in reqs)


def test_prompt_larger_than_the_cache_is_refused() -> None:
    s = make(blocks=2)
    with pytest.raises(ValueError, match="cannot fit the KV cache"):
        s.add(req("big", 8))
    s.add(req("ok", 3))
    with pytest.raises(ValueError, match="duplicate request id"):
        s.add(req("ok", 3))


def test_token_slice_spans_prompt_and_output() -> None:
    r = Request("s", [1, 2, 3], GREEDY)
    r.output_token_ids += [4, 5]
    whole = [1, 2, 3, 4, 5]
    for start in range(6):
        for end in range(start, 7):
            assert r.token_slice(start, end) == whole[start:end]


def test_pipeline_reset_recomputes_running_requests_and_announces_them_again() -> None:
    """After a stage is replaced: nothing in flight counts, running requests restart from their
    tokens (generated ones included), every request is announced again with its outputs, late
    results of voided plans are dropped, and every block comes back in the end."""
    s = make(pp=2, chunk=4)
    a, b, c = req("a", 6, SamplingParams(max_tokens=6, ignore_eos=True)), req("b", 3), req("c", 5)
    for r in (a, b):
        s.add(r)
    for _ in range(6):  # a and b get some tokens
        plan = s.schedule()
        if plan is None:
            break
        complete(s, plan)
    s.add(c)
    voided = s.schedule()
    assert voided is not None and a.output_token_ids
    outputs_before = list(a.output_token_ids)
    order = [r.request_id for r in s.running]

    preempted = s.reset_pipeline()
    assert preempted == len(order) and not s.inflight and not s.running
    assert [r.request_id for r in list(s.waiting)[: len(order)]] == order  # same order, at the head
    assert all(r.num_computed_tokens == 0 and not r.block_table for r in (a, b))
    assert s.update(StepResult(voided.mb_id, [Sampled(ch.request_id, 9) for ch in voided.chunks], [])) == []
    assert a.output_token_ids == outputs_before  # the late result changed nothing

    plan = s.schedule()
    assert plan is not None
    announced = {n.request_id: n.output_token_ids for n in plan.new_requests}
    assert announced["a"] == outputs_before
    first = next(ch for ch in plan.chunks if ch.request_id == "a")
    assert first.start == 0  # recomputed from the start: prompt + generated tokens
    complete(s, plan)
    drain(s)
    assert all(r.finished for r in (a, b, c)) and len(a.output_token_ids) == 6
    assert s.allocator.num_free == s.allocator.num_blocks


def test_only_a_repetition_penalty_sends_the_prompt_to_the_last_stage() -> None:
    """The penalty counts the prompt's tokens, which the last stage does not otherwise see (a
    cached prefix, KV imported from a prefill server): announced with the request, once."""
    s = make(chunk=4)
    penalised = req("p", 6, SamplingParams(max_tokens=2, repetition_penalty=1.2, ignore_eos=True))
    s.add(penalised)
    s.add(req("g", 6))
    plans = drain(s)
    announced = {n.request_id: n for plan in plans for n in plan.new_requests}
    assert announced["p"].prompt_token_ids == penalised.prompt_token_ids
    assert announced["p"].params.repetition_penalty == 1.2
    assert announced["g"].prompt_token_ids == []
    assert sum(len(plan.new_requests) for plan in plans) == 2


def chunks_of(plan: StepPlan) -> list[tuple[str, int, list[int], bool]]:
    return [(c.request_id, c.start, c.token_ids, c.follows) for c in plan.chunks]


def planned(s: Scheduler) -> StepPlan:
    plan = s.schedule()
    assert plan is not None
    return plan


def test_pp1_plans_the_next_decode_step_before_its_token_is_back() -> None:
    s = make(pp=1)
    r = req("a", 6)  # max_tokens 4
    s.add(r)
    prefill, ahead = planned(s), planned(s)
    assert s.schedule() is None  # two plans in flight, and the request is one step ahead at most
    assert chunks_of(prefill) == [("a", 0, list(range(10, 16)), False)]
    # Position 6 reads the token the prefill samples: the stage puts it in (Sampler.follow).
    assert chunks_of(ahead) == [("a", 6, [-1], True)]
    assert all(c.sample for p in (prefill, ahead) for c in p.chunks)
    complete(s, prefill, token=21)
    third = planned(s)
    assert chunks_of(third) == [("a", 7, [-1], True)]
    complete(s, ahead, token=22)
    fourth = planned(s)
    assert chunks_of(fourth) == [("a", 8, [-1], True)]  # samples the 4th token: nothing after it
    assert s.schedule() is None
    complete(s, third, token=23)
    assert s.schedule() is None
    complete(s, fourth, token=24)
    assert r.output_token_ids == [21, 22, 23, 24] and r.finish_reason == FinishReason.LENGTH
    assert not s.inflight and s.allocator.num_free == s.allocator.num_blocks


def test_a_step_planned_ahead_of_eos_is_dropped_and_frees_its_blocks_when_it_returns() -> None:
    s = make(pp=1, blocks=8)
    r = Request("a", [10, 11, 12], SamplingParams(max_tokens=10, temperature=0.0), eos_token_ids=(2,))
    s.add(r)
    first, ahead = planned(s), planned(s)
    assert ahead.chunks[0].follows
    complete(s, first, token=2)  # EOS
    assert r.finish_reason == FinishReason.STOP
    assert s.allocator.num_free < 8  # the step planned ahead still writes its blocks
    assert s.update(StepResult(ahead.mb_id, [Sampled("a", 5)], [])) == []  # its token is dropped
    assert r.output_token_ids == [2] and s.allocator.num_free == 8 and not s.has_work


@pytest.mark.parametrize(
    "settings, params",
    [
        ({"pp": 2}, GREEDY),  # the token is sampled on the last stage, embedded on the first
        ({"pp": 1, "decode_ahead": False}, GREEDY),
        ({"pp": 1}, SamplingParams(max_tokens=4, temperature=0.0, grammar='start: "x"')),  # masks are made early
        ({"pp": 1}, SamplingParams(max_tokens=1, temperature=0.0)),  # the token in flight is its last
    ],
)
def test_no_step_ahead(settings: dict[str, Any], params: SamplingParams) -> None:
    s = make(**settings)
    s.add(req("a", 5, params))
    plans = drain(s)
    assert not any(c.follows for p in plans for c in p.chunks)
    assert all(c.token_ids != [-1] for p in plans for c in p.chunks)


def test_a_request_short_of_kv_blocks_stops_the_others_running_ahead_and_preempts_the_newest() -> None:
    # 6 blocks of 4 tokens. "old" crosses into a new block every 4 steps and runs out first;
    # "new", always one step ahead, would never come to rest to be preempted if it kept going.
    s = make(pp=1, blocks=6)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    old, new = Request("old", list(range(8)), params), Request("new", list(range(50, 56)), params)
    s.add(old)
    s.add(new)
    plans = drain(s)
    assert s.num_preemptions >= 1
    assert [c.start for p in plans for c in p.chunks if c.request_id == "old" and c.new_table] == [0]
    assert len([c for p in plans for c in p.chunks if c.request_id == "new" and c.new_table]) > 1
    assert all(len(r.output_token_ids) == 12 for r in (old, new))
    assert s.allocator.num_free == 6


def test_a_step_ahead_takes_only_empty_blocks_never_a_cached_one() -> None:
    # 4 blocks of 4 tokens: "b" leaves its two full blocks cached, "a" takes the two empty ones.
    s = make(pp=1, blocks=4)
    s.add(Request("b", list(range(100, 108)), SamplingParams(max_tokens=1, temperature=0)))
    drain(s)
    assert (s.allocator.num_empty, s.allocator.num_evictable) == (2, 2)
    s.add(a := Request("a", list(range(10, 17)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
    prefill, ahead = planned(s), planned(s)
    assert chunks_of(ahead) == [("a", 7, [-1], True)]  # position 7: still a's second block
    complete(s, prefill)
    # Position 8 needs a third block, which only evicting "b"'s could give: for a token that
    # EOS may drop, "a" does not go ahead but rests until its token is back.
    assert s.schedule() is None and s.allocator.num_evictions == 0
    complete(s, ahead)
    step = planned(s)
    assert chunks_of(step) == [("a", 8, [7], False)] and s.allocator.num_evictions == 1
    complete(s, step)
    drain(s)
    assert len(a.output_token_ids) == 8


def test_the_spare_plan_at_pp1_is_only_for_requests_that_go_on_while_in_flight() -> None:
    grammar = SamplingParams(max_tokens=3, temperature=0.0, grammar='start: "x"')
    s = make(pp=1)
    s.add(req("g1", 4, grammar))
    first = planned(s)
    s.add(req("g2", 4, grammar))
    # g1 cannot go ahead (a grammar), and g2 alone in the spare plan would start a second, half
    # batch: g2 waits, and both decode in one batch from then on.
    assert s.schedule() is None
    complete(s, first)
    assert [c.request_id for c in planned(s).chunks] == ["g1", "g2"]
    # A prompt's next chunk goes into the spare plan: the stage has it queued behind the first.
    s = make(pp=1, chunk=8)
    s.add(req("p", 20))
    assert [chunks_of(p) for p in (planned(s), planned(s))] == [
        [("p", 0, list(range(10, 18)), False)],
        [("p", 8, list(range(18, 26)), False)],
    ]
    # Only an ended request's step is in flight (planned ahead past its EOS): there is no batch
    # to split, and a request that comes now starts at once.
    s = make(pp=1)
    s.add(Request("e", [10, 11, 12], SamplingParams(max_tokens=10, temperature=0.0), eos_token_ids=(2,)))
    first, _ = planned(s), planned(s)
    complete(s, first, token=2)
    s.add(req("n", 4))
    assert [c.request_id for c in planned(s).chunks] == ["n"]


def test_fail_all_frees_a_request_that_ended_with_a_step_in_flight() -> None:
    s = make(pp=1, blocks=8)
    s.add(Request("e", [10, 11, 12], SamplingParams(max_tokens=10, temperature=0.0), eos_token_ids=(2,)))
    first, _ = planned(s), planned(s)  # the second is planned ahead, past the EOS to come
    complete(s, first, token=2)
    s.add(req("w", 4))
    assert [r.request_id for r in s.fail_all()] == ["w"]
    assert not s.requests and s.allocator.num_free == 8
