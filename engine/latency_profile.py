"""Start-up latency profile of a stage: time synthetic prefills of several sizes and prefixes,
so the host can fit f(l) = a*l^2 + b*l + c before the first real prompt arrives.

The prefix's KV is not computed first: its contents do not change the time attention takes,
and the blocks written here are overwritten by any request before it reads them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from transport.messages import SeqChunk

Execute = Callable[[Sequence[SeqChunk], "torch.Tensor | None"], torch.Tensor]
BUDGET_S = 3.0  # profiling stops adding points after this long (once it has enough to fit)
MIN_POINTS = 8  # the fit's minimum (scheduler.chunk_predictor.MIN_FIT_POINTS)


def profile_points(chunk: int, max_tokens: int, lengths: int = 16) -> list[tuple[int, int]]:
    """(prefix, tokens) pairs: `lengths` chunk sizes from C/4 to 1.25*C from scratch, interleaved
    with chunks of C/2 and C after prefixes of C, 2C, 4C, 8C (what pins down the attention term),
    all within `max_tokens`. Interleaved so that a cut-off by the time budget keeps both kinds."""
    lo, hi = max(1, chunk // 4), max(2, chunk + chunk // 4)
    fresh = sorted({round(lo + (hi - lo) * i / (lengths - 1)) for i in range(lengths)})
    prefixed = [(p * chunk, x) for p in (1, 2, 4, 8) for x in (chunk // 2, chunk) if x >= 1]
    points: list[tuple[int, int]] = []
    for i in range(max(len(fresh), len(prefixed))):
        points += [(0, fresh[i])] if i < len(fresh) else []
        points += [prefixed[i]] if i < len(prefixed) else []
    return [(p, x) for p, x in points if p + x <= max_tokens]


def run_profile(
    execute: Execute,
    points: Sequence[tuple[int, int]],
    block_size: int,
    hidden_shape: tuple[int, torch.dtype] | None,
    budget_s: float = BUDGET_S,
) -> list[tuple[int, int, float]]:
    """Time `execute` on each (prefix, tokens) point; returns (prefix, tokens, seconds).
    `hidden_shape` (hidden size, dtype) for stages that take activations, None for the first."""

    def run(prefix: int, tokens: int) -> float:
        blocks = list(range(-(-(prefix + tokens) // block_size)))
        chunk = SeqChunk("profile", [0] * tokens, prefix, blocks, True)
        hidden = torch.zeros((tokens, hidden_shape[0]), dtype=hidden_shape[1]) if hidden_shape else None
        start = time.perf_counter()
        execute([chunk], hidden)
        return time.perf_counter() - start

    if not points:
        return []
    run(*points[0])  # warm-up: first calls allocate buffers and pick kernels
    samples: list[tuple[int, int, float]] = []
    deadline = time.perf_counter() + budget_s
    for prefix, tokens in points:
        if len(samples) >= MIN_POINTS and time.perf_counter() > deadline:
            break
        # The faster of two runs: delays (other processes still starting up, a late wake-up) only
        # ever add time, and they would bias the fit.
        samples.append((prefix, tokens, min(run(prefix, tokens), run(prefix, tokens))))
    return samples
