"""What `AsyncEngine.generate` yields: incremental outputs of one request."""

from __future__ import annotations

from dataclasses import dataclass


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
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    prompt_tokens: int
    completion_tokens: int  # so far
    cached_tokens: int = 0  # of prompt_tokens, how many were found in the prefix cache (not computed)
    logprobs: list[TokenLogprob] | None = None  # for token_ids, when asked for
