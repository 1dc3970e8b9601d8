"""The sampler's tensor functions: the distribution a draw follows (temperature, top-k, top-p,
min-p), the draw itself (inverse transform), and grammar bitmasks unpacked."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class SamplerParams(Protocol):
    """What sampling reads: satisfied by SamplingParams and by its wire form."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...
    @property
    def min_p(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def logprobs(self) -> int | None: ...
    @property
    def prompt_logprobs(self) -> int | None: ...
    @property
    def logit_bias(self) -> Sequence[tuple[int, float]]: ...
    @property
    def grammar(self) -> str | None: ...


# The draw sums weights in blocks of this many tokens (see `inverse_transform`), unless there are
# at most SMALL of them.
BLOCK = 256
SMALL = 4 * BLOCK


def inverse_transform(weights: torch.Tensor, u: list[float]) -> list[int]:
    """weights: [rows, n] >= 0, unnormalised, unit column stride -> per row, the index of the
    first weight whose cumulative sum exceeds u * the total (a zero weight is never chosen).

    In two levels: a block of BLOCK weights by the blocks' sums, then a weight within that block.
    Only one block per row is summed cumulatively: a cumulative sum over the whole vocabulary is
    a sequential pass (it cost more than the softmax), block sums are a vectorised reduction.
    Cumulative sums are float64, so that the draw follows the weights to far below any
    probability a test could see."""
    if weights.stride(1) != 1:
        weights = weights.contiguous()
    rows, n = weights.shape
    if n <= SMALL:  # a few candidates (top-k, top-p): one cumulative sum costs less than two levels
        cdf = weights.double().cumsum_(-1)
        target = torch.tensor(u, dtype=torch.float64, device=weights.device)[:, None] * cdf[:, -1:]
        return [int(i) for i in _first_above(cdf, target, weights)[:, 0].tolist()]
    full = n // BLOCK
    sums = weights.as_strided((rows, full, BLOCK), (weights.stride(0), BLOCK, 1)).sum(-1)  # [rows, blocks]
    if n % BLOCK:
        sums = torch.cat([sums, weights[:, full * BLOCK :].sum(-1, keepdim=True)], dim=1)
    cdf = sums.double().cumsum_(-1)
    target = torch.tensor(u, dtype=torch.float64, device=weights.device)[:, None] * cdf[:, -1:]
    block = _first_above(cdf, target, sums)  # [rows, 1]
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp_(min=0)), 0.0)
    columns = block * BLOCK + torch.arange(BLOCK, device=weights.device)  # [rows, BLOCK]
    inside = weights.gather(1, columns.clamp(max=n - 1)).masked_fill_(columns >= n, 0.0)
    inner = inside.double().cumsum_(-1)
    # The block's own cumulative sum ends slightly off its float32 sum: scale the target to it.
    share = ((target - before) / sums.gather(1, block).double()).clamp_(0.0, 1.0)
    picks = block * BLOCK + _first_above(inner, share * inner[:, -1:], inside)
    return [int(i) for i in picks[:, 0].tolist()]


def _first_above(cdf: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per row [rows, 1]: the first index whose cumulative sum `cdf` exceeds `target`, never past
    the last positive weight (a target rounded up to the total would otherwise pick beyond it)."""
    picks = torch.searchsorted(cdf, target, right=True)
    positions = torch.arange(weights.shape[1], device=weights.device)
    last = torch.where(weights > 0, positions, 0).amax(-1, keepdim=True)
    return torch.minimum(picks, last)


_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_mask(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmasks [rows, words] int32 -> allowed [rows, vocab_size] bool (bit t % 32 of word t // 32)."""
    bits = (masks.unsqueeze(-1) >> _SHIFTS) & 1  # [rows, words, 32]
    return bits.reshape(masks.shape[0], -1)[:, :vocab_size].bool()


# Top-p without top-k looks for its nucleus among this many of the most likely tokens first (a
# partial sort), and sorts the whole vocabulary only when they do not cover top_p.
TOP_P_CANDIDATES = 1024


def candidates(probs: torch.Tensor, params: SamplerParams) -> tuple[torch.Tensor, torch.Tensor]:
    """probs: [vocab] after temperature -> (weights, token ids) of the tokens a draw chooses among:
    top-k, then top-p of the top-k-renormalised distribution, then min-p (relative to the most
    likely token). Weights are unnormalised."""
    vocab = probs.shape[0]
    if params.top_k or params.top_p < 1.0:
        values, order = probs.topk(min(params.top_k or TOP_P_CANDIDATES, vocab))  # most likely first
        if params.top_p < 1.0:
            share = values / values.sum() if params.top_k else values
            if not params.top_k and float(values.sum()) < params.top_p and values.shape[0] < vocab:
                values, order = probs.sort(descending=True)  # the nucleus is wider than the candidates
                share = values
            # Drop a token once the tokens before it already cover top_p (the first always stays).
            keep = (share.cumsum(0) - share) < params.top_p
            keep[0] = True  # (a top_p below float32's smallest number compares as 0)
            values, order = values[keep], order[keep]
    else:
        values, order = probs, torch.arange(vocab, device=probs.device)
    if params.min_p > 0:
        values = values.masked_fill(values < params.min_p * values.max(), 0.0)
    return values, order
