"""Start-up latency profile of a stage: time synthetic prefills of several sizes and prefixes,
so the host can fit f(l) = a*l^2 + b*l + c before the first real prompt arrives.

The prefix's KV is not computed first: its contents do not change the time attention takes,
and the blocks written here are overwritten by any request before it reads them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ppserve.transport.messages import SeqChunk

Execute = Callable[[Sequence[SeqChunk], "torch.Tensor | None"], torch.Tensor]
BUDGET_S = 3.0  # after the from-scratch lengths, prefixed points are added until this much time has passed
LENGTHS = 16  # from-scratch chunk sizes, always timed


def profile_points(chunk: int, max_tokens: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(prefix, tokens) pairs, all within `max_tokens`: LENGTHS chunk sizes from C/4 to 1.25*C
    from scratch (what f(l) is fitted to), and chunks of C/2 and C after prefixes of C, 2C, 4C, 8C
    (which pin down the attention term at the prefixes long prompts reach)."""
    lo, hi = max(1, chunk // 4), max(2, chunk + chunk // 4)
    fresh = sorted({round(lo + (hi - lo) * i / (LENGTHS - 1)) for i in range(LENGTHS)})
    prefixed = [(p * chunk, x) for p in (1, 2, 4, 8) for x in (chunk // 2, chunk) if x >= 1]
    return [(0, x) for x in fresh if x <= max_tokens], [(p, x) for p, x in prefixed if p + x <= max_tokens]


def run_profile(
    execute: Execute,
    points: tuple[Sequence[tuple[int, int]], Sequence[tuple[int, int]]],
    block_size: int,
    hidden_shape: tuple[int, torch.dtype] | None,
    budget_s: float = BUDGET_S,
) -> list[tuple[int, int, float]]:
    """Time `execute` on each (prefix, tokens) point of `profile_points`: all the from-scratch ones,
    then prefixed ones while the time budget lasts. Returns (prefix, tokens, seconds).
    `hidden_shape` (hidden size, dtype) for stages that take activations, None for the first."""

    def run(prefix: int, tokens: int) -> float:
        blocks = list(range(-(-(prefix + tokens) // block_size)))
        chunk = SeqChunk("profile", [0] * tokens, prefix, blocks, True)
        hidden = torch.zeros((tokens, hidden_shape[0]), dtype=hidden_shape[1]) if hidden_shape else None
        start = time.perf_counter()
        out = execute([chunk], hidden)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)  # time the compute, not the kernel launches
        return time.perf_counter() - start

    fresh, prefixed = points
    if not fresh:
        return []
    run(*fresh[0])  # warm-up: first calls allocate buffers and pick kernels
    samples: list[tuple[int, int, float]] = []
    deadline = time.perf_counter() + budget_s
    for i, (prefix, tokens) in enumerate([*fresh, *prefixed]):
        if i >= len(fresh) and time.perf_counter() > deadline:
            break
        # The faster of two runs: delays (other processes still starting up, a late wake-up) only
        # ever add time, and they would bias the fit.
        samples.append((prefix, tokens, min(run(prefix, tokens), run(prefix, tokens))))
    return samples
