"""What `AsyncEngine.generate` yields: incremental outputs of one request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ppserve.scheduler.request import TokenScore


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]  # (token id, logprob), best first


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    text: str  # new text since the previous output
    token_ids: list[int]  # new token ids since the previous output
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    prompt_tokens: int
    completion_tokens: int  # so far
    cached_tokens: int = 0  # of prompt_tokens, how many were found in the prefix cache (not computed)
    logprobs: list[TokenLogprob] | None = None  # for token_ids, when asked for
    # Per prompt position, when asked for (SamplingParams.prompt_logprobs), in a request's first
    # output only: None for position 0 (nothing predicts it), else the prompt token's logprob and
    # the top N at that position.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str = ""  # why, when finish_reason is "error" (the output's grammar stopped)


def prompt_logprobs(prompt_token_ids: Sequence[int], scores: Sequence[TokenScore]) -> list[TokenLogprob | None] | None:
    """The scores collected for a prompt (scores[i] is of token i + 1), as RequestOutput gives them;
    None while some are missing (an aborted request's first output), rather than a silent part."""
    if len(scores) != len(prompt_token_ids) - 1:
        return None
    out: list[TokenLogprob | None] = [None]
    out += [TokenLogprob(t, lp, tuple(top)) for t, (lp, top) in zip(prompt_token_ids[1:], scores, strict=True)]
    return out
