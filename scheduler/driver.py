"""The async pipeline driver: keeps up to `depth` micro-batches in flight.

It knows nothing of sockets: plans go out through `send_plan`, results come in through
`on_result`. Everything runs on one event loop, so the scheduler needs no locks.

`send_plan` is synchronous (it only queues the plan), so no other task can run between
scheduling a plan and sending it: a pipeline reset can never fall between the two and leave a
stage with a plan from before the reset.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ppserve.scheduler.request import Request
from ppserve.scheduler.scheduler import Scheduler
from ppserve.transport.messages import Sampled, StepPlan, StepResult


class PipelineDriver:
    def __init__(
        self,
        scheduler: Scheduler,
        send_plan: Callable[[StepPlan], None],
        on_outputs: Callable[[list[tuple[Request, Sampled]], StepResult], None],
    ) -> None:
        self.scheduler = scheduler
        self.send_plan = send_plan
        self.on_outputs = on_outputs
        self.paused = False  # while the pipeline is being repaired: requests wait, nothing is planned
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """Something changed (a request arrived or ended, a result came back): plan again."""
        self._wake.set()

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self.wake()

    def on_result(self, result: StepResult) -> None:
        outputs = self.scheduler.update(result)
        # Plan the next micro-batch before handing out tokens: the stages wait on the plan,
        # while detokenizing and waking the readers of 100s of streams can wait a moment.
        self.wake()
        if outputs:
            asyncio.get_running_loop().call_soon(self.on_outputs, outputs, result)

    async def run(self) -> None:
        while True:
            plan = None if self.paused else self.scheduler.schedule()
            if plan is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            self.send_plan(plan)
