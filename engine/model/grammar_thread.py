"""The last stage's grammar thread, where it computes masks ahead of sampling, and when sampling
waits for it (engine/model/sampler.py)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch


def start_grammar_thread() -> ThreadPoolExecutor:
    """One worker, at the stage's own priority. At idle priority (Linux's SCHED_IDLE), tried for
    PP > 1, it was starved whenever both cores computed, and when that happened while it held the
    GIL or the grammar cache's lock, the compute thread waited for it (a priority inversion):
    constrained first tokens came later at PP=2 (docs/structured-outputs.md#how-it-works)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")


def wait_for(future: Future[torch.Tensor]) -> bool:
    """Whether sampling should wait for masks the grammar thread was given: yes once it has
    started them (or finished). Masks it has not started (it is still busy with others) are
    cancelled there (False), and the compute thread computes them itself rather than wait for
    the thread and then for them."""
    return not future.cancel()
