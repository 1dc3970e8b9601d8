"""Speculative decoding's pure parts: the drafters, the policy that sizes drafts, and the
scheduler's bookkeeping of a step with drafts (roll back, blocks given back, tables truncated)."""

from __future__ import annotations

import pytest

from ppserve.scheduler.drafter import Drafter, SuffixIndex, TokenBuffer
from ppserve.scheduler.request import Request
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.scheduler.scheduler import Scheduler, SchedulerConfig
from ppserve.scheduler.speculation import Speculator, StepCost
from ppserve.transport.messages import Sampled, StepPlan, StepResult, Timing


def _request(rid: str, prompt: list[int], max_tokens: int = 64, salt: str | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(rid, prompt, params, cache_salt=salt)


def test_ngram_lookup_takes_the_longest_latest_match() -> None:
    b = TokenBuffer()
    b.extend([1, 2, 3, 4, 5, 9, 9, 1, 2, 3])
    assert b.lookup(4) == [4, 5, 9, 9]  # "1 2 3" occurred before: what followed it
    b.extend([7, 2, 3])
    assert b.lookup(2) == [7, 2]  # "2 3" last occurred at the end of "1 2 3 7 2 3" minus the tail
    b.extend([8])
    assert b.lookup(3) == []  # 8 never occurred before
    lone = TokenBuffer()
    lone.extend([5])
    assert lone.lookup(3) == []  # nothing before the last token
    lone.extend(list(range(1000)))  # grows past its first allocation
    assert lone.length == 1001 and lone.tokens[-1] == 999


def test_a_copy_goes_on_where_it_reached_while_the_text_follows_it() -> None:
    lines = [7, 1, 2, 3, 10, 4, 1, 2, 3, 11, 4, 1, 2, 3, 12, 4, 8]  # three lines that begin alike
    copying = [9, 7, 1, 2, 3, 10, 4, 1, 2, 3, 11, 4, 1, 2, 3]  # a reply copying them, at line 3's start
    fresh = TokenBuffer()
    fresh.extend(lines + copying)
    assert fresh.lookup(3) == [11, 4, 1]  # the tail's latest occurrence: the reply's own line 2
    b = TokenBuffer()
    b.extend(lines + copying[:2])
    assert b.lookup(16) == lines[1:17]  # the copy begins at the prompt's first line
    b.extend(copying[2:])
    assert b.lookup(3) == [12, 4, 8]  # it goes on from where it reached: line 3
    b.extend([12, 5, 6, 1, 2])  # the reply leaves the copy: the latest occurrence again
    assert b.lookup(2) == [3, 12]


def test_suffix_index_is_per_tenant_and_bounded() -> None:
    index = SuffixIndex(capacity=20)
    index.add("a", [1, 2, 3, 4, 5])
    assert index.lookup("a", [9, 2, 3], 3) == [4, 5]
    assert index.lookup("b", [9, 2, 3], 3) == []  # another tenant's text is never drafted from
    index.add("a", list(range(100, 118)))  # 23 tokens: the oldest sequence goes
    assert index.size == 18
    assert index.lookup("a", [2, 3], 3) == []
    assert index.lookup("a", [105], 3) == [106, 107, 108]


def test_drafter_drafts_from_the_request_then_from_recent_requests() -> None:
    suffix = Drafter("suffix")
    done = _request("old", [10, 11, 12, 13, 14, 15])
    suffix.finished(done)
    r = _request("new", [1, 2, 3, 1, 2])
    assert suffix.propose(r, 2) == [3, 1]  # its own text first
    other = _request("other", [7, 12, 13])
    assert suffix.propose(other, 3) == [14, 15]  # then a finished request's
    assert Drafter("ngram").propose(other, 3) == []  # ngram looks at the request's own text only
    assert Drafter("off").propose(r, 3) == []
    with pytest.raises(ValueError, match="speculative must be one of"):
        Drafter("medusa")


def test_draft_length_follows_acceptance_and_falls_to_zero_when_compute_bound() -> None:
    spec = Speculator("ngram", 8)
    copying = _request("c", list(range(50)) * 3)
    for _ in range(20):  # accepted every time
        draft, _ = spec.drafts(copying, 8, 1, 1)
        copying.spec_hits += len(draft)
        copying.spec_tries += len(draft)
    assert len(spec.drafts(copying, 8, 1, 1)[0]) == 8
    assert len(spec.drafts(copying, 3, 1, 1)[0]) == 3  # never beyond the limit

    poor = _request("p", list(range(50)) * 3)
    for _ in range(20):  # rejected at once every time
        draft, _ = spec.drafts(poor, 8, 1, 1)
        poor.spec_tries += 1
    assert len(spec.drafts(poor, 8, 1, 1)[0]) <= 1

    # Compute-bound: each row costs as much as a one-row step. With 32 decode rows in the plan, a
    # request that copies almost surely still drafts a little, one that does not drafts nothing.
    for rows in range(1, 33):
        spec.observe_step(rows, 0.01 * rows)
    assert spec.cost.ratio > 5
    assert spec.drafts(poor, 8, 32, 32)[0] == []
    assert len(spec.drafts(copying, 8, 32, 32)[0]) < 8
    assert not spec.wants(poor, 32)


def test_step_cost_fits_the_slope() -> None:
    cost = StepCost()
    assert cost.ratio == StepCost.PRIOR_RATIO  # nothing seen yet
    for rows in (1, 2, 4, 8, 1, 2, 4, 8):
        cost.observe(rows, 0.015 + 0.0015 * rows)
    assert cost.ratio == pytest.approx(0.1, rel=1e-3)


def _step(s: Scheduler, plan: StepPlan, made: dict[str, list[int]]) -> None:
    """The last stage's answer to `plan`: for each sampling chunk, the tokens in `made` (default:
    the first draft rejected, token 0)."""
    samples = [Sampled(c.request_id, t) for c in plan.chunks if c.sample for t in made.get(c.request_id, [0])]
    s.update(StepResult(plan.mb_id, samples, [Timing(0, 0.0, 0.01)]))


def _decoding(blocks: int, prompt: list[int], first: int, max_tokens: int = 64) -> tuple[Scheduler, Request, StepPlan]:
    """A scheduler whose one request has prefilled `prompt` and sampled `first`, and the plan of
    its first decode step."""
    s = Scheduler(SchedulerConfig(num_blocks=blocks, block_size=4, pp_size=1, decode_ahead=False))
    r = _request("r", prompt, max_tokens)
    s.add(r)
    plan = s.schedule()
    assert plan is not None
    _step(s, plan, {"r": [first]})
    plan = s.schedule()
    assert plan is not None
    return s, r, plan


def test_a_step_with_drafts_rolls_back_what_was_rejected_and_gives_its_blocks_back() -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]  # "1 2 3" recurs: drafts "4 5 6 ..."
    s, r, plan = _decoding(16, prompt, 4)  # the prefill's token: "... 1 2 3 4"
    free_before = s.allocator.num_free + len(r.block_table) - 3  # with the drafts' block back
    (chunk,) = plan.chunks
    assert chunk.drafts >= 2 and chunk.token_ids[:3] == [4, 5, 6] and chunk.sample
    assert len(r.block_table) > 3  # the drafts took a block of their own
    # The first draft kept, the second not: tokens 5 and 9 come back.
    _step(s, plan, {"r": [5, 9]})
    assert r.output_token_ids == [4, 5, 9]
    assert r.num_computed_tokens == r.num_scheduled_tokens == len(prompt) + 2  # "... 4 5" in the KV
    assert len(r.block_table) == 3 and s.allocator.num_free == free_before
    assert s.spec.stats.draft_tokens == chunk.drafts and s.spec.stats.accepted_tokens == 1
    after = s.schedule()
    assert after is not None
    assert ("r", 3) in after.truncated  # the stages drop the draft block too
    assert after.chunks[0].start == len(prompt) + 2 and after.chunks[0].token_ids[0] == 9


def test_drafts_stop_at_max_tokens_and_never_preempt() -> None:
    s, r, plan = _decoding(4, [1, 2, 3, 1, 2, 3, 1, 2], 3, max_tokens=3)
    assert plan.chunks[0].drafts == 1  # 3 tokens at most: this step makes the other two
    _step(s, plan, {"r": [1, 2]})
    assert r.finished and s.allocator.num_free == 4
    # A full cache: the drafts shrink to the empty blocks there are.
    s, r, plan = _decoding(3, [1, 2, 3, 1, 2, 3, 1, 2, 3, 1], 2)
    assert plan.chunks[0].drafts == 1 and len(r.block_table) == 3  # positions 10 and 11: block 2's last
