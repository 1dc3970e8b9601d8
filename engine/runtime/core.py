"""EngineCore: the serving loop, the whole of it in `run`.

    plan while the pipeline has room -> submit each plan -> await the oldest micro-batch's
    result -> update the scheduler -> emit what it sampled

The scheduler decides everything (which requests, which KV blocks, how large a chunk); an
executor runs the plans: every stage in this process (`InProcessExecutor`: tests, offline
generation) or the stage processes (`StagePoolExecutor`). Both run plans strictly in order and
return results in that order. Everything runs on one event loop, so the scheduler needs no locks.

The loop pauses (`pause`) while a failed stage is replaced; `AsyncEngine` does the replacing.
"""

from __future__ import annotations

from typing import Protocol

from ppserve.engine.runtime.timeline import Timeline
from ppserve.scheduler.request import Request
from ppserve.scheduler.scheduler import Scheduler
from ppserve.transport.messages import Sampled, StepPlan, StepResult

Outputs = list[tuple[Request, Sampled | None]]  # None: an embedding ended the request


class Executor(Protocol):
    def submit(self, plan: StepPlan) -> None:
        """Queue a plan (synchronous: nothing else runs between scheduling a plan and sending it,
        so a pipeline reset can never fall between the two)."""

    async def next_result(self) -> StepResult | None:
        """The oldest plan's result, or None when `interrupt` woke the loop first."""

    def interrupt(self) -> None:
        """Wake a `next_result` that waits: something changed that may let the scheduler plan."""


class OutputSink(Protocol):
    def emit(self, outputs: Outputs, result: StepResult) -> None:
        """Hand what a micro-batch sampled to its requests' readers (called for every result, also
        one that sampled nothing)."""


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, sink: OutputSink, timeline: Timeline) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.sink = sink
        self.timeline = timeline  # recent per-stage compute intervals (metrics, the bubble plot)
        self.paused = False  # while the pipeline is being repaired: requests wait, nothing is planned

    async def run(self) -> None:
        """The engine. Runs until cancelled; an exception here is the engine's death."""
        outputs: Outputs = []
        result: StepResult | None = None
        while True:
            while not self.paused and (plan := self.scheduler.schedule()) is not None:
                self.timeline.on_plan(plan)
                self.executor.submit(plan)
            # Tokens go out after planning: the stages wait on the plan, while detokenizing and
            # waking the readers of 100s of streams can wait a moment.
            if result is not None:
                self.sink.emit(outputs, result)
            result = await self.executor.next_result()
            if result is None or result.mb_id not in self.scheduler.inflight:
                # Woken (a request came or went), or a result of a plan voided by a reset.
                outputs, result = [], None
                continue
            self.timeline.on_result(result)
            outputs = self.scheduler.update(result)

    def wake(self) -> None:
        """A request arrived or ended, or KV blocks were freed outside a step: plan again."""
        self.executor.interrupt()

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self.wake()

    def reset_pipeline(self) -> int:
        """Every plan in flight is void (a stage was replaced and the others dropped what they
        held): the running requests are preempted, to be recomputed from their tokens. Returns
        how many were."""
        self.timeline.forget_in_flight()
        return self.scheduler.reset_pipeline()
