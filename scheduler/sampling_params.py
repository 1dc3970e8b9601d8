"""Per-request sampling settings. Pure data: travels to the last stage once per request.

`SamplingParams` is the one definition of the sampling parameters: each field's name, type,
default and range (msgspec `Meta` constraints on its type) are declared here and nowhere else.
Everything else derives from it, through FIELDS (what scheduler/sampling_fields.py reads there):
`SamplingParams` checks itself with them; the HTTP request structs take their defaults and the
integer ranges (checked while decoding) from here (server/protocol.py); the OpenAPI document
and `ppserve generate`'s flags are generated from them (server/openapi.py, server/cli_sampling.py);
the wire struct, which transport declares on its own (it imports nothing of ours), is built and
read field by field through `wire()` and `from_wire()`; tests/scheduler/test_sampling_definition.py checks
that it, the HTTP structs, the OpenAPI document and the flags all agree with the declaration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from msgspec import Meta

from ppserve.scheduler.sampling_fields import FieldSpec, fields_of
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

# The integer ranges, named because the HTTP structs decode with them too (a value that fits
# JSON but not the wire is a 400 naming the field there, before any SamplingParams is built).
TokenCount = Annotated[int, Meta(ge=1, le=MAX_INT32)]
TokenId = Annotated[int, Meta(ge=0, le=MAX_INT32)]  # int32 like a token id: token ids, top_k
Seed = Annotated[int, Meta(ge=0, le=MAX_SEED)]
NumLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]  # OpenAI's range
StopString = Annotated[str, Meta(min_length=1)]

# Fields that stay on the host, which decides when a request stops; the rest travel to the last
# stage as WireSamplingParams.
HOST_ONLY = frozenset({"max_tokens", "stop_token_ids", "stop", "ignore_eos"})
# Fields with a form of their own in each API (OpenAI's `logit_bias` object, `response_format` and
# `structured_outputs` for the grammar), checked in __post_init__ rather than derived (FIELDS
# leaves them out: no CLI flag, no generated range). Both travel to the last stage.
OWN_FORM = {"own_form": True}
MAX_LOGIT_BIAS = 1024  # entries; OpenAI's values are in [-100, 100]
MAX_GRAMMAR_CHARS = 128 * 1024  # llguidance's grammar text (engine/model/grammar.py builds it)


def _doc(text: str) -> Meta:
    """A field's description: `ppserve generate --help` shows it (and the range and default)."""
    return Meta(description=text)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: Annotated[TokenCount, _doc("tokens to generate")] = 16
    temperature: Annotated[float, Meta(ge=0), _doc("0 = greedy")] = 1.0
    top_k: Annotated[TokenId, _doc("sample from the k most likely tokens; 0 = off")] = 0
    top_p: Annotated[float, Meta(gt=0, le=1), _doc("sample from the most likely tokens covering p")] = 1.0
    min_p: Annotated[float, Meta(ge=0, le=1), _doc("drop tokens below min_p x the top probability")] = 0.0
    # OpenAI semantics: over generated tokens only.
    presence_penalty: Annotated[Penalty, _doc("lowers the logit of each token already generated")] = 0.0
    frequency_penalty: Annotated[Penalty, _doc("lowers a token's logit per time it was generated")] = 0.0
    # vLLM / transformers semantics: over the prompt's tokens and the generated ones, a seen token's
    # logit is divided by it when positive, multiplied when negative (1 = off).
    repetition_penalty: Annotated[
        float, Meta(gt=0, le=MAX_REPETITION_PENALTY), _doc("1 = off; over prompt and output")
    ] = 1.0
    seed: Annotated[Seed, _doc("makes the draws reproducible")] | None = None
    # None = off; N = chosen token plus the top N.
    logprobs: Annotated[NumLogprobs, _doc("also return the top N logprobs")] | None = None
    # None = off; N = each prompt token's logprob plus the top N at its position. Such a request
    # computes its whole prompt: it never starts from cached blocks, which have no logits.
    prompt_logprobs: Annotated[NumLogprobs, _doc("also return each prompt token's logprob and the top N")] | None = None
    stop_token_ids: Annotated[tuple[TokenId, ...], _doc("token ids that end the output")] = ()
    # Matched on the host's text.
    stop: Annotated[tuple[StopString, ...], _doc("text that ends the output")] = ()
    ignore_eos: Annotated[bool, _doc("keep generating past EOS")] = False
    # (token id, bias) pairs, each bias in [-100, 100] added to that token's logit before sampling
    # (-100 bans the token, +100 all but forces it); sorted by id, one entry per id.
    logit_bias: tuple[tuple[int, float], ...] = field(default=(), metadata=OWN_FORM)
    # Constrained decoding: llguidance's grammar, from engine.model.grammar.build_grammar (a JSON
    # schema, a regex, choices, EBNF); every token sampled keeps the output inside it.
    grammar: str | None = field(default=None, metadata=OWN_FORM)

    def __post_init__(self) -> None:
        # The one check of every range, whoever builds the params: the HTTP layer, the CLI, an
        # embedding app, or the prefill side of disaggregation from a peer's WireSamplingParams
        # (`from_wire`). Each error names its field so the HTTP layer can return it as a 400.
        for spec in FIELDS:
            spec.check(getattr(self, spec.name))
        object.__setattr__(self, "logit_bias", _checked_bias(self.logit_bias))
        if self.grammar is not None and (not isinstance(self.grammar, str) or len(self.grammar) > MAX_GRAMMAR_CHARS):
            raise ValueError(f"grammar must be a string of at most {MAX_GRAMMAR_CHARS} characters")

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
        """What the last stage needs to sample and score (stopping is decided on the host): every
        field but HOST_ONLY, floats as floats (a caller may have given temperature=0)."""
        values: dict[str, Any] = {}
        for name in WireSamplingParams.__struct_fields__:
            value = getattr(self, name)
            if name == "logit_bias":
                value = list(value)
            elif name in BY_NAME and BY_NAME[name].kind is float:
                value = float(value)
            values[name] = value
        return WireSamplingParams(**values)


def _checked_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as pairs sorted by token id; ValueError naming the field if an entry is out of range."""
    try:
        pairs = [(t, b) for t, b in (bias.items() if isinstance(bias, dict) else bias)]
    except (TypeError, ValueError):
        raise ValueError("logit_bias must be (token id, bias) pairs") from None
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(pairs)} entries, more than {MAX_LOGIT_BIAS}")
    for t, b in pairs:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_INT32:
            raise ValueError(f"logit_bias keys must be token ids (integers in [0, {MAX_INT32}]), got {t!r}")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")
    if len({t for t, _ in pairs}) != len(pairs):
        raise ValueError("logit_bias has a token id more than once")
    return tuple(sorted((t, float(b)) for t, b in pairs))


FIELDS: tuple[FieldSpec, ...] = fields_of(SamplingParams)
BY_NAME: dict[str, FieldSpec] = {spec.name: spec for spec in FIELDS}
