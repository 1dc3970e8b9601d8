"""Decode steps of one batch, timed (and optionally profiled) inside the engine's own loop.

`StepTimes` is the in-process executor with a stopwatch: the `EngineCore` plans as it always
does, and every plan in which each request of the batch decodes one token is timed (the
forward pass of every stage and sampling; the scheduler's share is not in it). Benchmarks run
a batch through `OfflineEngine(config, StepTimes(...))` and read the times afterwards."""

from __future__ import annotations

import time
from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile

from ppserve.engine.config import EngineConfig
from ppserve.engine.runtime.executors import InProcessExecutor
from ppserve.transport.messages import StepPlan, StepResult


class StepTimes(InProcessExecutor):
    def __init__(
        self,
        config: EngineConfig,
        batch: int,
        after_step: Callable[[], object] | None = None,
        profiled: range = range(0),
    ) -> None:
        super().__init__(config)
        self.batch = batch
        self.after_step = after_step  # run after each timed step, outside its time (a peer's step)
        self.profiled = profiled  # which decode steps (by index) to profile
        self.times: list[float] = []  # seconds per decode step of the whole batch
        self.profile: profile | None = None
        self.profiled_all = False  # every step of `profiled` ran, and the profile stopped

    def run(self, plan: StepPlan) -> StepResult:
        if len(plan.chunks) != self.batch or any(c.num_new != 1 for c in plan.chunks):
            return super().run(plan)  # prefill, or not every request decoding yet
        step = len(self.times)
        if step == self.profiled.start and self.profiled:
            # Started here, on the compute thread, so that it records this thread's ops.
            self.profile = profile(activities=[ProfilerActivity.CPU])
            self.profile.start()
        start = time.perf_counter()
        result = super().run(plan)
        self.times.append(time.perf_counter() - start)
        if self.profile is not None and step == self.profiled.stop - 1:
            self.profile.stop()
            self.profiled_all = True
        if self.after_step is not None:
            self.after_step()
        return result
