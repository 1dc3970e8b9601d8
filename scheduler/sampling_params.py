"""Per-request sampling settings. Pure data: travels to the last stage once per request."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ppserve.transport.messages import WireSamplingParams

MAX_TOP_LOGPROBS = 20
# Integer fields cross process boundaries as msgpack integers and reach torch as int64 or int32:
# ranges that fit, so that a huge value is a clear error here rather than a failure mid-pipeline.
MAX_INT32 = 2**31 - 1
MAX_SEED = 2**63 - 1
GREEDY_BELOW = 1e-5  # temperatures this small are greedy (dividing by them overflows)
# SGLang's range: a penalty beyond 2 makes every seen token (the prompt's too) nearly impossible,
# and the output degenerates; a finite bound keeps inf and NaN out of the sampler.
MAX_REPETITION_PENALTY = 2.0


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0  # OpenAI semantics: over generated tokens only
    frequency_penalty: float = 0.0
    # vLLM / transformers semantics: over the prompt's tokens and the generated ones, a seen token's
    # logit is divided by it when positive, multiplied when negative (1 = off).
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: int | None = None  # None = off; N = chosen token plus the top N (N <= 20)
    # None = off; N = each prompt token's logprob plus the top N at its position (N <= 20). Such a
    # request computes its whole prompt: it never starts from cached blocks, which have no logits.
    prompt_logprobs: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings, matched on the host's text
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # The one check of every range, whoever builds the params: the HTTP layer, the CLI, an
        # embedding app, or the prefill side of disaggregation from a peer's WireSamplingParams
        # (`from_wire`). Each error names its field so the HTTP layer can return it as a 400.
        if not _int_in(self.max_tokens, 1, MAX_INT32):
            raise ValueError(f"max_tokens must be an integer in [1, {MAX_INT32}], got {self.max_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not _int_in(self.top_k, 0, MAX_INT32):
            raise ValueError(f"top_k must be an integer in [0, {MAX_INT32}] (0 disables it), got {self.top_k!r}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _finite(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty!r}"
            )
        if self.seed is not None and not _int_in(self.seed, 0, MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2**63 - 1], got {self.seed!r}")
        if self.logprobs is not None and not _int_in(self.logprobs, 0, MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and not _int_in(self.prompt_logprobs, 0, MAX_TOP_LOGPROBS):
            raise ValueError(
                f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}"
            )
        if not all(_int_in(t, 0, MAX_INT32) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers in [0, {MAX_INT32}], got {self.stop_token_ids!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")

    @classmethod
    def from_wire(cls, w: WireSamplingParams, **fields: object) -> SamplingParams:
        """The params a peer sent (its WireSamplingParams), checked as any request's are: a value
        out of range is a ValueError naming the field. `fields` adds those the wire form lacks
        (max_tokens, stop, ...)."""
        wired = {name: getattr(w, name) for name in w.__struct_fields__}
        return cls(**{**wired, **fields})

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def wire(self) -> WireSamplingParams:
        """What the last stage needs to sample and score (stopping is decided on the host)."""
        return WireSamplingParams(
            temperature=float(self.temperature),
            top_k=self.top_k,
            top_p=float(self.top_p),
            min_p=float(self.min_p),
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty),
            seed=self.seed,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )


def _int_in(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
