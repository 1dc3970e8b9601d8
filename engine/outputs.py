"""What `AsyncEngine.generate` yields: incremental outputs of one request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ppserve.engine.runtime.expert_load import LayerLoad
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
    embedding: list[float] | None = None  # an embedding request's (AsyncEngine.embed), once finished
    # Speculative decoding, so far: draft tokens verified, those kept, and the steps that carried them.
    draft_tokens: int = 0
    accepted_tokens: int = 0
    spec_steps: int = 0


def prompt_logprobs(prompt_token_ids: Sequence[int], scores: Sequence[TokenScore]) -> list[TokenLogprob | None] | None:
    """The scores collected for a prompt (scores[i] is of token i + 1), as RequestOutput gives them;
    None while some are missing (an aborted request's first output), rather than a silent part."""
    if len(scores) != len(prompt_token_ids) - 1:
        return None
    out: list[TokenLogprob | None] = [None]
    out += [TokenLogprob(t, lp, tuple(top)) for t, (lp, top) in zip(prompt_token_ids[1:], scores, strict=True)]
    return out


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics and health pages."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    stage_busy: tuple[float, ...]  # per stage: fraction of the recent window spent computing
    prefill_chunks: dict[int, int]  # prefill chunk size -> how many were scheduled (since start)
    latency_model: tuple[float, float, float] | None  # (a, b, c) of the bottleneck stage, if fitted
    preemptions: int  # requests preempted (KV given up, recomputed later) since start
    stage_restarts: tuple[int, ...]  # per stage: times its process was replaced
    recovering: bool  # a failed stage is being replaced; requests wait
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache (since start)
    prefix_cache_hits: int  # ... found there, not computed
    prefix_cache_blocks: int  # KV blocks holding a findable prefix now (in use or kept for reuse)
    prefix_cache_evictions: int  # cached blocks given to new contents (since start)
    stage_tokens: tuple[int, ...]  # per stage: tokens its layers computed (since start)
    # Speculative decoding since start (vLLM's spec_decode counters): steps that carried drafts,
    # draft tokens, and those kept.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    stage_nodes: tuple[tuple[str, str], ...] = ()  # under Ray, per stage: its node's Ray id and address
    moe: tuple[LayerLoad, ...] = ()  # a mixture of experts' load per MoE layer (engine/runtime/expert_load.py)
