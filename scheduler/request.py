"""A request's progress: prompt and output tokens, how many are in the KV cache, when it stops.

Progress is `num_computed_tokens` catching up with `num_tokens`; prefill and decode are not modes,
just how far behind the computed count is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.transport.messages import PromptTargets

# Longest `cache_salt`: it is hashed once per request, but it also travels (HTTP, RoomOpen).
MAX_CACHE_SALT_CHARS = 256
# A prompt token's score: its logprob, and the top N (token id, logprob) at its position.
TokenScore = tuple[float, list[tuple[int, float]]]


class FinishReason(StrEnum):
    STOP = "stop"  # EOS or a stop token (stop strings are matched on text, by the engine)
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"
    ERROR = "error"  # the request could not go on (its grammar stopped): Request.error says why


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 1 << 30
    # Prefix caching: only requests with the same salt (or none) share cached blocks. It changes
    # which blocks a request may find, never its outputs, so the stages never see it.
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # in the KV cache on every stage
    block_table: list[int] = field(default_factory=list)
    # A model with sliding-window layers: their blocks, entry for entry as block_table's, the
    # first `window_freed` slid out (FREED: scheduler/window_kv.py). Empty for other models.
    window_table: list[int] = field(default_factory=list)
    window_freed: int = 0
    finish_reason: FinishReason | None = None
    error: str = ""  # why it ended, when finish_reason is ERROR
    # Pipeline bookkeeping (scheduler only): tokens computed or in flight, plans in flight that
    # carry this request, how many of them sample (two while a decode step runs ahead of its
    # token: scheduler.py), whether the last stage knows it, and how many of block_table's first
    # blocks the stages hold (sent in earlier plans).
    num_scheduled_tokens: int = 0
    inflight_plans: int = 0
    samples_in_flight: int = 0
    announced: bool = False
    num_blocks_sent: int = 0
    # Prefill/decode disaggregation: on the prefill side, the KV outlives the request until its
    # transfer is done (`KvHandover.release`).
    hold_kv: bool = False
    # Bytes the last stage's compiled grammar costs (engine/model/grammar_check.py), for its cache.
    grammar_cost: int = 0
    # Prefix caching: the hash of each full block of tokens so far (block_allocator.block_hash),
    # computed once; and how many prompt tokens its first admission found cached (None before).
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int | None = None
    # Prompt logprobs collected so far: entry i scores prompt token i + 1. They survive
    # preemption, so a recomputed prompt only scores the tokens still missing.
    prompt_scores: list[TokenScore] = field(default_factory=list)
    # An embedding request: its prompt's last row is pooled (StepPlan.pooled), nothing is sampled,
    # and it ends with `embedding` set.
    pool: bool = False
    embedding: list[float] | None = None
    # Speculative decoding (scheduler/speculation.py): the drafts of its step in flight (forced by
    # its grammar, or guessed), the tokens its grammar forces next, its acceptance counts (fading),
    # and what it drafted and kept so far (its usage).
    drafts: list[int] = field(default_factory=list)
    draft_forced: bool = False
    forced: list[int] = field(default_factory=list)
    spec_hits: float = 0.0
    spec_tries: float = 0.0
    spec_faded: int = 0  # num_tokens when the counts last faded
    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if len(self.prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(self.prompt_token_ids)} tokens; the model's context length is "
                f"{self.max_model_len}, which leaves no room to generate"
            )
        salt = self.cache_salt
        if salt is not None and not (isinstance(salt, str) and 1 <= len(salt) <= MAX_CACHE_SALT_CHARS):
            raise ValueError(f"cache_salt must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole sequence (a decode
        step needs one token, and this runs for every request in every plan)."""
        prompt = self.prompt_token_ids
        if start >= len(prompt):
            return self.output_token_ids[start - len(prompt) : end - len(prompt)]
        if end <= len(prompt):
            return prompt[start:end]
        return prompt[start:] + self.output_token_ids[: end - len(prompt)]

    def add_prompt_scores(self, start: int, logprobs: list[float], top: list[list[tuple[int, float]]]) -> None:
        """Scores of prompt tokens from position `start` on; positions collected already are
        skipped (a chunk computed again after a preemption). Chunks of one request come back in
        order, so `start` never lies beyond the next position wanted."""
        skip = len(self.prompt_scores) + 1 - start
        if skip < 0:
            raise ValueError(f"prompt logprobs of {self.request_id!r} from position {start} leave a gap")
        self.prompt_scores += zip(logprobs[skip:], top[skip:], strict=True)

    def prompt_targets(self, index: int, start: int, n: int) -> PromptTargets | None:
        """What chunk `index` of a plan (tokens [start, start + n)) scores: the row at position p
        predicts prompt token p + 1, wanted while p + 1 is in the prompt and not scored yet."""
        first = max(start, len(self.prompt_scores))  # prompt_scores covers tokens 1 .. len
        end = min(start + n, len(self.prompt_token_ids) - 1)
        if first >= end:
            return None
        return PromptTargets(index, first - start, self.prompt_token_ids[first + 1 : end + 1])

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append_token(self, token_id: int) -> FinishReason | None:
        """Record a sampled token; returns (and records) why the request finished, if it did."""
        self.output_token_ids.append(token_id)
        p = self.params
        if token_id in p.stop_token_ids or (not p.ignore_eos and token_id in self.eos_token_ids):
            self.finish_reason = FinishReason.STOP
        elif len(self.output_token_ids) >= p.max_tokens or self.num_tokens >= self.max_model_len:
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason
