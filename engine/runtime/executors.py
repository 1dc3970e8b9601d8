"""The two ways `EngineCore` runs its plans.

- `InProcessExecutor`: every stage's runner in this process, called in turn on one worker thread
  (the event loop stays free). Tests and offline generation use it; it is the reference the
  stage processes must agree with.
- `StagePoolExecutor`: the stage processes (stage_pool.py), each plan sent to every stage, the
  last stage's result read back.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from ppserve.engine.config import EngineConfig
from ppserve.engine.runtime.prompt_logprobs import last_stage_outputs, make_sampler, prompt_rows
from ppserve.engine.runtime.stage_pool import StagePool
from ppserve.engine.runtime.stage_runner import StageRunner
from ppserve.transport.messages import SeqChunk, StepPlan, StepResult


class InProcessExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        # Loaded on the thread that computes, as a stage process loads its model. Each thread that
        # runs parallel torch work gets an OpenMP team of its own; with more of them than cores,
        # OpenMP stops spinning between parallel regions, and every GEMM of a step then waits for
        # its sleeping threads to wake, which made SmolLM2's batch-1 GEMMs much slower.
        self.runners = self._thread.submit(lambda: [StageRunner(config, i) for i in range(config.pp_size)]).result()
        # The last stage's sampling state: the stage processes keep the same (stage_worker.py).
        self.sampler = make_sampler(config)
        self._plans: deque[StepPlan] = deque()
        self._woken = False  # a plan or a wake-up came since the last `next_result`
        self._waiter: asyncio.Future[None] | None = None  # while `next_result` waits for one

    def forward(
        self, chunks: Sequence[SeqChunk], all_logits: bool = False, prompt_rows: Sequence[int] = ()
    ) -> torch.Tensor:
        """Chunks that carry whole block tables (reference passes) through every stage in turn;
        returns the last stage's logits. The runners' kept tables are not touched."""
        out: torch.Tensor | None = None
        for runner in self.runners:
            out = runner.execute(chunks, out, all_logits=all_logits, prompt_rows=prompt_rows)
        assert out is not None
        return out

    def run(self, plan: StepPlan) -> StepResult:
        """A plan, run as the stage processes run it (without timings): each runner applies the
        plan's block-table changes to the tables it keeps, in plan order."""
        rows = prompt_rows(plan)
        self.sampler.prepare(plan)  # grammar masks: computed while the stages run
        plan = self.sampler.follow(plan)  # the tokens of steps planned ahead (PP=1)
        logits: torch.Tensor | None = None
        for runner in self.runners:
            logits = runner.execute_plan(plan, logits, prompt_rows=rows)
        assert logits is not None
        samples, prompt_logprobs, pooled = last_stage_outputs(self.sampler, plan, logits, self.runners[-1].pooled)
        return StepResult(plan.mb_id, samples, [], prompt_logprobs, pooled)

    def submit(self, plan: StepPlan) -> None:
        self._plans.append(plan)
        self.interrupt()

    def interrupt(self) -> None:
        self._woken = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next_result(self) -> StepResult | None:
        if not self._plans:
            if not self._woken:
                # A future per wait, not an Event: offline generation runs each batch in a new loop.
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            self._woken = False
            if not self._plans:
                return None
        plan = self._plans.popleft()
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.run, plan)

    def reset(self) -> None:
        """Void the queued plans, the block tables and the sampling state, as a pipeline reset
        does to the stages (the scheduler then sends every table whole again). Runs on the compute
        thread, after the plan it may still be computing (its awaiting loop was cancelled)."""
        self._plans.clear()
        self._thread.submit(self._clear).result()

    def _clear(self) -> None:
        self.sampler.clear()
        for runner in self.runners:
            runner.clear_tables()

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


class StagePoolExecutor:
    def __init__(self, pool: StagePool) -> None:
        self.pool = pool
        self._woken = False  # a wake-up is queued among the results: one is enough

    def submit(self, plan: StepPlan) -> None:
        self.pool.send_plan(plan)

    async def next_result(self) -> StepResult | None:
        result = await self.pool.results.get()
        if result is None:
            self._woken = False
        return result

    def interrupt(self) -> None:
        if not self._woken:
            self._woken = True
            self.pool.results.put_nowait(None)
