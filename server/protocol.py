"""Request bodies of the HTTP and websocket APIs, decoded and checked in one place.

Bodies are decoded with msgspec into typed Structs, so a wrong type is an error that names its
field (`at $.max_tokens`). Every integer field carries the range of the type it travels as
(int32 token ids and counts, an int64 seed), checked while decoding: a number that fits JSON
but not the engine's wire format is a 400 here, not a failure deep in the engine. The rest of
the ranges are checked by `SamplingParams` itself, where all are declared. Every problem becomes an `ApiError`, which
the app turns into OpenAI's JSON error shape. The JSON itself is read by server/json_body.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec

from ppserve.engine.model.grammar import build_grammar
from ppserve.scheduler.request import MAX_CACHE_SALT_CHARS
from ppserve.scheduler.sampling_params import (
    MAX_INT32,
    NumLogprobs,
    SamplingParams,
    Seed,
    TokenCount,
    TokenId,
)
from ppserve.server.errors import ApiError
from ppserve.server.structured import ResponseFormat, StructuredOutputs
from ppserve.server.tool_calls import Tool, ToolCall, ToolChoice, calls_schema, check_tools

T = TypeVar("T")
MAX_N = 16  # choices per request (each is a full request in the engine)
RETRY_AFTER_S = 1  # what 503 answers suggest
MAX_ID_CHARS = 256  # websocket request ids are echoed in every event: keep them short

# Defaults and ranges come from SamplingParams, where they are declared. The integer ranges are
# checked while decoding (token ids, top_k and counts travel as int32, seeds as int64), so that
# the error names the field as the client wrote it; the others by SamplingParams itself, whose
# messages say the whole range. tests/scheduler/test_sampling_definition.py checks that every field is here.
_DEFAULT = SamplingParams()
# A limit the request may leave out: then the model's own default applies (ServerState.max_tokens),
# or this one (OpenAI's for completions, and SamplingParams'), or for chat the rest of the context.
DEFAULT_MAX_TOKENS = _DEFAULT.max_tokens
_MAX_TOKENS_DEFAULT = (
    "default: the model's generation_config.json max_new_tokens if it has one, else "
    f"{DEFAULT_MAX_TOKENS} (chat: the rest of the context); never more than the context leaves"
)
MaxTokens = Annotated[TokenCount | None, msgspec.Meta(description=_MAX_TOKENS_DEFAULT)]
# /v1/completions also takes 0 with echo: the prompt is scored, nothing generated (as vLLM and
# lm-evaluation-harness's `local-completions` use it).
CompletionMaxTokens = Annotated[
    Annotated[int, msgspec.Meta(ge=0, le=MAX_INT32)] | None,
    msgspec.Meta(description=f"{_MAX_TOKENS_DEFAULT}; 0 (with echo): only the prompt, with its logprobs if asked"),
]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
# Strings the server keeps or echoes but does not use: as short as an id. (A model name is
# compared and echoed in the error; Hugging Face's are under 100 characters.)
ShortText = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
# vLLM's field: only requests with the same salt (and, by default, the same API key) share cached
# prompt prefixes (server/tenants.py).
CacheSalt = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=MAX_CACHE_SALT_CHARS,
        description="only requests with the same cache_salt (and API key) share cached prompt prefixes",
    ),
]


# ppserve's: `usage.speculative` (draft tokens, accepted tokens, mean acceptance length) is an
# extension a client asks for, so that a plain OpenAI client's usage keeps OpenAI's shape.
SpeculativeUsageFlag = Annotated[
    bool,
    msgspec.Meta(
        description="true: usage also has `speculative` (draft_tokens, accepted_tokens, mean_acceptance_length) "
        "where the request's steps carried drafts"
    ),
]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    """Sampling fields shared by every endpoint (OpenAI's names plus the usual extensions)."""

    temperature: float = _DEFAULT.temperature
    top_p: float = _DEFAULT.top_p
    top_k: TokenId = _DEFAULT.top_k
    min_p: float = _DEFAULT.min_p
    seed: Seed | None = _DEFAULT.seed
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] = []
    presence_penalty: float = _DEFAULT.presence_penalty
    frequency_penalty: float = _DEFAULT.frequency_penalty
    repetition_penalty: float = _DEFAULT.repetition_penalty
    ignore_eos: bool = _DEFAULT.ignore_eos
    # OpenAI's: token id (as a string) -> bias in [-100, 100]; checked by SamplingParams.
    logit_bias: dict[str, float] | None = None
    structured_outputs: StructuredOutputs | None = None

    def constraint(self) -> tuple[str, tuple[str, Any]] | None:
        """The output's constraint, if any: (the request field it came from, (kind, spec))."""
        c = self.structured_outputs.constraint() if self.structured_outputs else None
        return ("structured_outputs", c) if c else None

    def grammar(self) -> str | None:
        given = self.constraint()
        if given is None:
            return None
        field_name, (kind, spec) = given
        try:
            return build_grammar(kind, spec)
        except ValueError as e:
            raise ApiError(400, f"{field_name}: {e}", field_name) from None

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            # ASCII digits only: str.isdigit() takes "²" and other digits int() refuses, and a key
            # of thousands of digits is no token id (int() refuses those past 4,300 digits).
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ApiError(400, f"logit_bias keys must be token ids, got {key[:40]!r}", "logit_bias")
            pairs.append((int(key), bias))
        try:
            return SamplingParams(logit_bias=tuple(pairs)).logit_bias
        except ValueError as e:
            raise ApiError(400, str(e), "logit_bias") from None

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        logit_bias, grammar = self._logit_bias(), self.grammar()
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                min_p=self.min_p,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                seed=self.seed,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                stop_token_ids=tuple(self.stop_token_ids),
                stop=tuple(stop),
                ignore_eos=self.ignore_eos,
                logit_bias=logit_bias,
                grammar=grammar,
            )
        except ValueError as e:
            raise invalid(str(e)) from None


class _OpenAIRequest(_Sampling, kw_only=True):
    model: ShortText | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: ShortText | None = None
    cache_salt: CacheSalt | None = None
    response_format: ResponseFormat | None = None
    speculative_usage: SpeculativeUsageFlag = False

    def constraint(self) -> tuple[str, tuple[str, Any]] | None:
        own = self.response_format.constraint() if self.response_format else None
        other = super().constraint()
        if own and other:
            raise ApiError(400, "give one of response_format and structured_outputs", "response_format")
        return ("response_format", own) if own else other

    def check(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise ApiError(400, f"n must be in [1, {MAX_N}], got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options needs stream: true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_OpenAIRequest, kw_only=True):
    prompt: Any  # str | list[str] | list[int] | list[list[int]]: checked by `prompts()`
    max_tokens: CompletionMaxTokens = None
    logprobs: NumLogprobs | None = None
    echo: bool = False  # with logprobs: the prompt tokens' logprobs too (its first token's is null)
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens 0 needs echo: true (then the prompt is returned, scored)", "max_tokens")

    @property
    def prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        return prompt_list(self.prompt, "prompt")


def prompt_list(p: Any, field: str) -> list[str | list[int]]:
    """A prompt field's four OpenAI forms (a string, a list of strings, a list of token ids, or a
    list of those), as a list of text or token-id prompts."""
    if isinstance(p, str) or (isinstance(p, list) and p and _is_ids(p)):
        prompts: list[str | list[int]] = [p]
    elif isinstance(p, list) and p and all(isinstance(t, str) or _is_ids(t) for t in p):
        prompts = list(p)
    else:
        raise ApiError(
            400, f"{field} must be a string, a list of strings, a list of token ids, or a list of those", field
        )
    if any(len(x) == 0 for x in prompts):
        raise ApiError(400, f"{field} must not be empty", field)
    for ids in prompts:
        if isinstance(ids, list):
            _check_ids(ids, field)
    return prompts


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/embeddings (server/embeddings_api.py)."""

    input: Any  # str | list[str] | list[int] | list[list[int]]: checked by `prompt_list`
    model: ShortText | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    user: ShortText | None = None
    cache_salt: CacheSalt | None = None


class ChatMessage(msgspec.Struct):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: ShortText | None = None  # a tool's result: the call it answers
    name: ShortText | None = None

    def text(self) -> str:
        """Plain text content; content parts must all be text."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, "only text content parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)


def chat_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as the chat template takes it (for /v1/chat/completions and ws `chat`);
    tool calls as Hugging Face templates take them (arguments as an object)."""
    if not messages:
        raise ApiError(400, "messages must not be empty", "messages")
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            d["tool_calls"] = [c.template_form() for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


class ChatRequest(_OpenAIRequest, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: MaxTokens = None
    max_completion_tokens: MaxTokens = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools
    parallel_tool_calls: bool = True

    def check(self) -> None:
        super().check()
        if not self.messages:
            raise ApiError(400, "messages must not be empty", "messages")
        check_tools(self.tools, self.tool_choice)
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")

    @property
    def tool_mode(self) -> ToolChoice | None:
        """None without tools (or with tool_choice "none"), else "auto", "required" or a name."""
        if not self.tools or self.tool_choice == "none":
            return None
        return self.tool_choice or "auto"

    def constraint(self) -> tuple[str, tuple[str, Any]] | None:
        other = super().constraint()
        mode = self.tool_mode
        schema = calls_schema(self.tools, mode, self.parallel_tool_calls) if self.tools and mode else None
        if schema is None:
            return other
        if other:
            raise ApiError(400, f"tool_choice {mode!r} constrains the output; {other[0]} cannot too", other[0])
        return "tools", ("json", schema)

    def chat_messages(self) -> list[dict[str, Any]]:
        return chat_dicts(self.messages)

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: ShortText | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt only: the template writes a chat's special tokens
    add_generation_prompt: bool = True  # messages only

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ApiError(400, "give either prompt or messages", "prompt" if self.prompt is None else "messages")


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: ShortText | None = None
    tokens: list[TokenId]


class NativeSampling(_Sampling, kw_only=True, forbid_unknown_fields=True):
    max_tokens: MaxTokens = None
    logprobs: NumLogprobs | None = None

    def params(self, max_tokens: int) -> SamplingParams:
        """The sampling parameters, with `max_tokens` resolved by the server (see MaxTokens)."""
        return self.sampling_params(max_tokens, self.logprobs)


class GenerateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /generate and the websocket's `generate` message."""

    text: str | None = None
    input_ids: list[int] | None = None  # range: `prompt()`, in the words the prompt field uses
    sampling_params: NativeSampling = msgspec.field(default_factory=NativeSampling)
    stream: bool = False
    cache_salt: CacheSalt | None = None
    speculative_usage: SpeculativeUsageFlag = False

    def prompt(self) -> str | list[int]:
        if (self.text is None) == (self.input_ids is None):
            raise ApiError(400, "give exactly one of text and input_ids", "text")
        prompt: str | list[int] = self.text if self.text is not None else list(self.input_ids or [])
        if not prompt:
            raise ApiError(400, "the prompt must not be empty", "text" if self.text is not None else "input_ids")
        if isinstance(prompt, list):
            _check_ids(prompt, "input_ids")
        return prompt

    def params(self, max_tokens: int) -> SamplingParams:
        return self.sampling_params.params(max_tokens)


class WsGenerate(GenerateRequest, tag="generate", kw_only=True, forbid_unknown_fields=True):
    id: RequestId


class WsChat(msgspec.Struct, tag="chat", kw_only=True, forbid_unknown_fields=True):
    """A conversation, rendered with the chat template as /v1/chat/completions renders it."""

    id: RequestId
    messages: list[ChatMessage]
    sampling_params: NativeSampling = msgspec.field(default_factory=NativeSampling)
    cache_salt: CacheSalt | None = None
    speculative_usage: SpeculativeUsageFlag = False

    def chat_messages(self) -> list[dict[str, Any]]:
        return chat_dicts(self.messages)

    def params(self, max_tokens: int) -> SamplingParams:
        return self.sampling_params.params(max_tokens)


class WsCancel(msgspec.Struct, tag="cancel", kw_only=True, forbid_unknown_fields=True):
    id: RequestId


class WsAuth(msgspec.Struct, tag="auth", kw_only=True, forbid_unknown_fields=True):
    """The API key, from a client that could not send it as a header (a browser)."""

    api_key: str


WsMessage = WsGenerate | WsChat | WsCancel | WsAuth


def invalid(message: str) -> ApiError:
    """A ValueError from the engine as a 400; the message starts with the field it is about."""
    first = message.split(" ", 1)[0]
    return ApiError(400, message, first if first.isidentifier() else None)


def _check_ids(ids: list[int], field: str) -> None:
    """Token ids fit int32 (the vocabulary check comes later, in the engine). min and max scan
    at C speed: a 16 MiB body holds millions of ids."""
    if min(ids) < 0 or max(ids) > MAX_INT32:
        raise ApiError(400, f"prompt token ids must be in [0, {MAX_INT32}]", field)


def _is_ids(value: object) -> bool:
    """A list of ints (not bools), tested at C speed: `map(type)` sees the exact type."""
    return isinstance(value, list) and (not value or set(map(type, value)) == {int})
