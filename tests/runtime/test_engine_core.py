"""EngineCore's loop on its own: a scripted executor stands in for the stages."""

from __future__ import annotations

import asyncio
import inspect
from collections import deque

from ppserve.engine.runtime.core import EngineCore, Outputs
from ppserve.engine.runtime.timeline import Timeline
from ppserve.scheduler.request import Request
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.scheduler.scheduler import Scheduler, SchedulerConfig
from ppserve.transport.messages import Sampled, StepPlan, StepResult

PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


class Stages:
    """Plans are answered when the test says so (`answer`), oldest first, token 7 each."""

    def __init__(self) -> None:
        self.plans: deque[StepPlan] = deque()
        self.results: asyncio.Queue[StepResult | None] = asyncio.Queue()

    def submit(self, plan: StepPlan) -> None:
        self.plans.append(plan)

    def interrupt(self) -> None:
        self.results.put_nowait(None)

    async def next_result(self) -> StepResult | None:
        return await self.results.get()

    def answer(self) -> StepPlan:
        plan = self.plans.popleft()
        self.results.put_nowait(StepResult(plan.mb_id, [Sampled(c.request_id, 7) for c in plan.chunks if c.sample], []))
        return plan


class Sink:
    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def emit(self, outputs: Outputs, result: StepResult) -> None:
        for r, s in outputs:
            assert s is not None, "no embeddings here"
            self.tokens.setdefault(r.request_id, []).append(s.token_id)


async def settle() -> None:
    for _ in range(5):  # the loop's task runs what is ready
        await asyncio.sleep(0)


async def test_the_loop_plans_answers_and_emits_in_order() -> None:
    scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, pp_size=2))
    stages, sink = Stages(), Sink()
    core = EngineCore(scheduler, stages, sink, Timeline(2))
    task = asyncio.create_task(core.run())
    try:
        scheduler.add(Request("a", [1, 2, 3], PARAMS))
        core.wake()  # added while the loop waits: it plans at once
        await settle()
        assert len(stages.plans) == 1
        core.pause()  # as during a recovery: results are taken, nothing new is planned
        stages.answer()
        await settle()
        assert not stages.plans and sink.tokens == {"a": [7]}
        core.resume()
        await settle()
        assert len(stages.plans) == 1
        # A stage was replaced: the plan in flight is void, its late result is dropped, and the
        # request is computed again from its tokens.
        assert core.reset_pipeline() == 1
        request = scheduler.requests["a"]
        stages.answer()
        await settle()
        assert sink.tokens == {"a": [7]}
        [recompute] = stages.plans
        assert recompute.chunks[0].token_ids == [1, 2, 3, 7] and recompute.chunks[0].start == 0
        while stages.plans:
            stages.answer()
            await settle()
        assert request.finished and sink.tokens == {"a": [7, 7, 7]}
        assert scheduler.allocator.num_free == 16
    finally:
        task.cancel()


def test_the_loop_is_one_short_function() -> None:
    lines = inspect.getsource(EngineCore.run).splitlines()
    assert len(lines) <= 40, f"EngineCore.run has {len(lines)} lines"
