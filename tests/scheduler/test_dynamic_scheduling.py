"""Dynamic chunking inside the scheduler, the latency tracker, the start-up profile points and
the timeline: all without processes (results and timings fed back by hand)."""

from __future__ import annotations

import itertools

import pytest

from ppserve.engine.runtime.latency_profile import LENGTHS, profile_points
from ppserve.engine.runtime.timeline import Timeline, bubble_fractions, intervals_from_trace
from ppserve.scheduler.chunk_predictor import LatencyModel
from ppserve.scheduler.latency_tracker import REFIT_EVERY, LatencyTracker
from ppserve.scheduler.request import Request
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.scheduler.scheduler import Scheduler, SchedulerConfig
from ppserve.transport.messages import Sampled, SeqChunk, StepPlan, StepResult, Timing

TRUE = LatencyModel(a=2e-9, b=2e-5, c=1e-3)  # per stage, seconds


def _profile(model: LatencyModel, chunk: int) -> list[tuple[int, int, float]]:
    fresh, prefixed = profile_points(chunk, 1 << 20)
    return [(p, x, model.chunk(p, x)) for p, x in [*fresh, *prefixed]]


def _scheduler(chunk: int = 512, budget: int = 4096, smooth: float = 1.0, pp: int = 2) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=4096,
            block_size=16,
            pp_size=pp,
            max_batched_tokens=budget,
            chunked_prefill_size=chunk,
            dynamic_chunking=True,
            chunk_smooth=smooth,
        )
    )


def _result(plan: StepPlan, pp: int, model: LatencyModel) -> StepResult:
    """What the stages would report: a token for sampling chunks, each stage's modelled time."""
    seconds = sum(model.chunk(c.start, c.num_new) for c in plan.chunks)
    timings = [Timing(stage, 100.0, 100.0 + seconds) for stage in range(pp)]
    return StepResult(plan.mb_id, [Sampled(c.request_id, 7) for c in plan.chunks if c.sample], timings)


def _prefill_chunks(s: Scheduler, prompt: int, model: LatencyModel = TRUE) -> list[int]:
    s.add(Request("long", list(range(prompt)), SamplingParams(max_tokens=2, ignore_eos=True)))
    sizes: list[int] = []
    while s.has_work:
        plans = []
        while (plan := s.schedule()) is not None:
            plans.append(plan)
        for plan in plans:
            sizes += [c.num_new for c in plan.chunks if c.is_prefill]
            s.update(_result(plan, s.config.pp_size, model))
    return sizes


def test_scheduled_chunks_shrink_with_the_prefix() -> None:
    s = _scheduler()
    s.set_profile(0, _profile(TRUE, 512))
    s.set_profile(1, _profile(TRUE, 512))
    sizes = _prefill_chunks(s, 20_000)
    assert sum(sizes) == 20_000
    assert sizes[0] == 512 and all(x >= y for x, y in itertools.pairwise(sizes[:-1]))
    assert sizes[-2] <= 256 and all(x >= 128 and x % 64 == 0 for x in sizes[:-1])  # floor C/4, aligned


def test_without_a_profile_chunks_are_fixed_and_the_budget_still_caps_them() -> None:
    assert set(_prefill_chunks(_scheduler(), 5000)[:-1]) == {512}  # no model yet: fixed
    s = _scheduler(chunk=512, budget=300)
    s.set_profile(0, _profile(TRUE, 512))
    assert max(_prefill_chunks(s, 5000)) <= 300


def test_online_refit_tracks_a_slower_machine() -> None:
    s = _scheduler(pp=2)
    s.set_profile(0, _profile(TRUE, 512))
    s.set_profile(1, _profile(TRUE, 512))
    before = s.latency.model
    slower = LatencyModel(a=4 * TRUE.a, b=TRUE.b, c=TRUE.c)  # attention got 4x slower
    _prefill_chunks(s, 40_000, model=slower)
    after = s.latency.model
    assert before is not None and after is not None and after.a > 1.5 * before.a
    assert s.chunker.model == after


def test_tracker_refit_cadence_window_and_bottleneck() -> None:
    tracker = LatencyTracker(num_stages=2, initial_chunk=512)
    fast, slow_attention = TRUE, LatencyModel(a=3 * TRUE.a, b=0.5 * TRUE.b, c=TRUE.c)
    tracker.set_profile(0, _profile(fast, 512))
    tracker.set_profile(1, _profile(slow_attention, 512))
    # At a long prefix stage 1 is the slower one, although its first chunk is faster.
    assert slow_attention.chunk(0, 512) < fast.chunk(0, 512)
    assert tracker.bottleneck == 1 and tracker.model is not None
    assert tracker.model.a == pytest.approx(slow_attention.a, rel=1e-6)
    refits = [tracker.observe(i % 2, 4096, 512, 0.1) for i in range(4 * REFIT_EVERY)]
    assert refits.count(True) == 2 and refits[2 * REFIT_EVERY - 1] and refits[-1]
    assert tracker.set_profile(0, []) is not None  # stage 1 still fits
    empty = LatencyTracker(num_stages=1, initial_chunk=512)
    assert empty.set_profile(0, [(0, 100, 0.01)] * 3) is None and empty.model is None


def test_profile_points_span_the_chunk_and_fit_the_cache() -> None:
    fresh, prefixed = profile_points(512, max_tokens=3000)
    assert len(fresh) == LENGTHS and fresh[0] == (0, 128) and fresh[-1] == (0, 640)
    assert prefixed and all(p > 0 and p + x <= 3000 for p, x in prefixed)
    assert profile_points(512, max_tokens=300) == ([(0, x) for _, x in fresh if x <= 300], [])


def test_timeline_busy_bubbles_and_trace_round_trip() -> None:
    timeline = Timeline(pp_size=2)
    plan = StepPlan(0, [SeqChunk("a", [1] * 100, 50, [0], False), SeqChunk("b", [2], 9, [1], True)])
    timeline.on_plan(plan)
    timeline.on_result(StepResult(0, [], [Timing(0, 10.0, 11.0), Timing(1, 11.0, 13.0)]))
    (i0, i1) = timeline.intervals
    assert (i0.kind, i0.tokens, i0.prefix) == ("mixed", 101, 50)
    assert timeline.prefill_chunks == {100: 1}  # the decode step is not a prefill chunk
    assert timeline.busy_fractions(since=9.0, now=13.0) == (0.25, 0.5)
    assert bubble_fractions(list(timeline.intervals), 2) == [pytest.approx(2 / 3), pytest.approx(1 / 3)]
    assert intervals_from_trace(timeline.chrome_trace()) == [i0, i1]
