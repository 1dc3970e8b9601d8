"""A scheduler on its own, driven by hand: no processes, each plan answered as the last stage
would answer it."""

from __future__ import annotations

import random
from typing import Any

from ppserve.scheduler.request import Request
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.scheduler.scheduler import Scheduler, SchedulerConfig
from ppserve.transport.messages import Sampled, StepPlan, StepResult

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def make(
    pp: int = 2, blocks: int = 64, chunk: int = 8, budget: int = 64, running: int = 64, **settings: Any
) -> Scheduler:
    """A scheduler with the production defaults but for what a test is about, and no drafts: the
    tests' last stage (`complete`) makes one token a step (tests/scheduler/test_drafter.py has drafts)."""
    return Scheduler(
        SchedulerConfig(
            num_blocks=blocks,
            block_size=4,
            pp_size=pp,
            max_running_requests=running,
            max_batched_tokens=budget,
            chunked_prefill_size=chunk,
            **{"speculative": "off", **settings},
        )
    )


def req(rid: str, n: int, params: SamplingParams = GREEDY) -> Request:
    return Request(rid, list(range(10, 10 + n)), params)


def complete(s: Scheduler, plan: StepPlan, token: int = 7) -> None:
    """What the last stage would answer: a token for every sampling chunk."""
    s.update(StepResult(plan.mb_id, [Sampled(c.request_id, token) for c in plan.chunks if c.sample], []))


def drain(s: Scheduler, rng: random.Random | None = None) -> list[StepPlan]:
    """Run to completion, answering in-flight plans in order (or in random order)."""
    plans: list[StepPlan] = []
    inflight: list[StepPlan] = []
    for _ in range(10_000):
        while (plan := s.schedule()) is not None:
            plans.append(plan)
            inflight.append(plan)
        if not inflight:
            break
        complete(s, inflight.pop(rng.randrange(len(inflight)) if rng else 0))
    assert not s.has_work
    return plans
