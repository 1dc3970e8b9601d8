"""Scripted pipeline steps for tests: the engine core's own loop, with a test deciding what
happens between steps.

A `Stepper` is an executor: each step the stages run the oldest plan in flight (every runner
of an in-process pipeline, in turn), then the test's script may add or abort requests or reset
the pipeline before the core plans the next step. Tests use it where arrivals and aborts must
fall at exact steps, so that two runs (prefix caching on and off, say) see the same schedule of
events."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from ppserve.engine.offline import OfflineEngine
from ppserve.engine.runtime.core import EngineCore, Outputs
from ppserve.engine.runtime.timeline import Timeline
from ppserve.scheduler.scheduler import Scheduler
from ppserve.transport.messages import StepPlan, StepResult

MAX_STEPS = 10_000


class Stepper:
    def __init__(self, pipe: OfflineEngine, scheduler: Scheduler) -> None:
        self.pipe = pipe
        self.scheduler = scheduler
        self.core = EngineCore(scheduler, self, self, Timeline(pipe.config.pp_size))
        self.step = 0
        self.ran: list[StepPlan] = []  # every plan the stages ran, in order
        self._plans: deque[StepPlan] = deque()
        self._script: Callable[[Stepper], bool] = lambda _: False
        self._more = True  # the script has events left
        self._started = False
        self._over: asyncio.Event | None = None

    def run(self, script: Callable[[Stepper], bool]) -> None:
        """Steps until the script is done (it returns False), no request has work and nothing is
        in flight. `script(self)` runs before each step is planned, `self.step` telling which."""
        self._script = script

        async def main() -> None:
            self._over = asyncio.Event()
            loop, over = asyncio.create_task(self.core.run()), asyncio.create_task(self._over.wait())
            await asyncio.wait({loop, over}, return_when=asyncio.FIRST_COMPLETED)
            for task in (loop, over):
                task.cancel()
            if loop.done() and not loop.cancelled():
                loop.result()  # the loop's own error

        asyncio.run(main())

    def reset(self) -> int:
        """As when a stage is replaced: the plans in flight are void, the last stage forgets its
        requests, the running requests are preempted (returned: how many)."""
        self._plans.clear()
        self.pipe.executor.reset()
        return self.core.reset_pipeline()

    # ---- the executor ---------------------------------------------------------------------

    def submit(self, plan: StepPlan) -> None:
        self._plans.append(plan)

    def interrupt(self) -> None:
        pass  # the script's events happen inside `next_result`, where the loop waits anyway

    async def next_result(self) -> StepResult | None:
        if not self._started:  # step 0's events, then the core plans step 0
            self._started = True
            self._more = self._script(self)
            return None
        result = None
        if self._plans:
            plan = self._plans.popleft()
            self.ran.append(plan)
            result = self.pipe.executor.run(plan)
        self.step += 1
        assert self.step < MAX_STEPS
        if self._more:
            self._more = self._script(self)
        elif not self.scheduler.has_work and not self._plans and result is None:
            assert self._over is not None
            self._over.set()
            await asyncio.Event().wait()  # the run is over: the core waits here until cancelled
        return result

    # ---- the output sink: requests keep their own tokens ----------------------------------

    def emit(self, outputs: Outputs, result: StepResult) -> None:
        pass
