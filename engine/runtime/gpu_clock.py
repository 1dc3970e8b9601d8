"""When a micro-batch computed on a stage, on the wall clock, without stalling the GPU."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ppserve.transport.messages import Timing


@dataclass(frozen=True)
class Span:
    """When a micro-batch computed on this stage. On CUDA the call returns once the kernels are
    queued, so the span comes from CUDA events around them instead, placed on the wall clock
    through a reference event (`GpuClock`). They are read in the send task (which waits for the
    output anyway), never with a synchronize on the compute thread."""

    start: float  # time.time() when the compute began
    end: float  # ... and when the call returned
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    clock: GpuClock | None = None
    tokens: int = 0  # rows the stage's layers computed

    def timing(self, stage: int) -> Timing:
        """Blocks until the kernels are done, on CUDA (call it off the event loop there)."""
        if self.events is None or self.clock is None:
            return Timing(stage, self.start, self.end, self.tokens)
        begin, finish = self.events
        finish.synchronize()
        return Timing(stage, self.clock.wall(begin), self.clock.wall(finish), self.tokens)


class GpuClock:
    """Wall-clock times of CUDA events: one reference event, recorded and waited for once at
    start-up, when time.time() is read too; later events are that time plus their distance."""

    def __init__(self) -> None:
        self.ref = torch.cuda.Event(enable_timing=True)
        self.ref.record()
        self.ref.synchronize()
        self.at = time.time()

    def wall(self, event: torch.cuda.Event) -> float:
        return self.at + self.ref.elapsed_time(event) / 1e3
