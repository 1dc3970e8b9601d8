"""The last stage's grammar thread: where it computes masks ahead of sampling, at what priority,
and when sampling waits for it (engine/model/sampler.py)."""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

log = logging.getLogger(__name__)


def start_grammar_thread() -> ThreadPoolExecutor:
    """One worker. Where this stage's compute threads are fewer than the cores it may use (several
    unpinned stages on one machine), it runs at idle priority, on cycles no stage wants; at normal
    priority the masks took CPU from the last stage, the pipeline's bottleneck
    (docs/structured-outputs.md). Where the stage's threads take every core, there is no idle
    time to use, and it keeps normal priority."""
    can_idle = hasattr(os, "SCHED_IDLE") and hasattr(os, "sched_getaffinity")
    idle = can_idle and torch.get_num_threads() < len(os.sched_getaffinity(0))
    init = _idle_priority if idle else None
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar", initializer=init)


def wait_for(future: Future[torch.Tensor]) -> bool:
    """Whether sampling should wait for masks the grammar thread was given: yes once it has
    started them (or finished). Masks it has not started are cancelled there (False), and the
    compute thread computes them itself: at idle priority the grammar thread may have had no CPU
    yet, and waiting would add a hand-over to computing them anyway."""
    return not future.cancel()


def _idle_priority() -> None:
    """The calling thread runs only when a core would otherwise idle (Linux's SCHED_IDLE).
    Sampling does not wait on it for masks it has not started (`wait_for`); one it has started
    is delayed at most until a core frees, as the waiting compute thread's own does."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError as e:  # a sandbox may refuse it: the thread then keeps normal priority
        log.debug("the grammar thread keeps normal priority: %s", e)
