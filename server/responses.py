"""Response bodies of the HTTP API and events of the websocket, as msgspec Structs.

They describe what the handlers send (which build plain dicts of the same shape, for speed) in
the OpenAPI document (server/openapi.py); tests check real answers against them. Requests are
in server/protocol.py.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from ppserve.transport.messages import StageKernels

FinishReason = Literal["stop", "length", "abort"]


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    """Every error, whatever the endpoint (`ApiError.body()`); also the last event of a stream
    that failed after its 200 went out."""

    error: ErrorDetail


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int  # prompt tokens found in the prefix cache rather than computed


class CompletionTokensDetails(msgspec.Struct):
    """OpenAI's prediction-token counts, which speculative decoding's drafts fill in."""

    accepted_prediction_tokens: int  # drafts verified and kept
    rejected_prediction_tokens: int


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None  # where the request's steps carried drafts
    # ppserve's own: only for a request with speculative_usage: true, where its steps carried drafts
    speculative: SpeculativeUsage | None = None


class CompletionLogprobs(msgspec.Struct):
    """OpenAI's legacy completions shape: parallel lists, one entry per generated token; with
    echo, the prompt's tokens come first (the first has null: nothing predicts it), and each of
    their top dicts holds the prompt's own token too."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None  # null in stream chunks until the choice ends


class Completion(msgspec.Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(msgspec.Struct):
    """One `data:` event of a streamed completion; with `include_usage`, a last one has no choices."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatTopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(msgspec.Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(msgspec.Struct):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    synthetic: bool  # stages that only model timing (--synthetic-latency): the text is meaningless


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[ModelCard]


class EmbeddingData(msgspec.Struct):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 (encoding_format)


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ResponseObject(msgspec.Struct):
    """POST /v1/responses (OpenAI's Responses API); `output` holds one message or the function calls."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[dict[str, Any]]
    output_text: str
    usage: dict[str, Any] | None


class AnthropicMessage(msgspec.Struct):
    """POST /v1/messages (Anthropic's Messages API); `content` holds text or tool_use blocks."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: dict[str, int]


class TypedEvent(msgspec.Struct):
    """One event of a Responses or Messages stream, sent as `event: <type>` then `data: <json>`;
    its other fields are those of its type in the API it belongs to."""

    type: str


class SpeculativeUsage(msgspec.Struct):
    """Speculative decoding's share of a request: draft tokens verified and kept, and the tokens
    each step that carried drafts made on average (the kept drafts plus one)."""

    draft_tokens: int
    accepted_tokens: int
    mean_acceptance_length: float


class NativeUsage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # of prompt_tokens, found in the prefix cache rather than computed
    speculative: SpeculativeUsage | None = None  # with speculative_usage: true, where steps carried drafts


class NativeLogprob(msgspec.Struct):
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]  # [token_id, logprob] pairs, most likely first


class GenerateResult(msgspec.Struct):
    id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: NativeUsage
    logprobs: list[NativeLogprob] | None = None  # present when sampling_params.logprobs is set


class GenerateChunk(msgspec.Struct):
    """One `data:` event of a streamed /generate; the last one has `usage`."""

    id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    usage: NativeUsage | None = None


class FlushCacheResult(msgspec.Struct):
    freed_blocks: int  # cached KV blocks that nobody used, now free (blocks in use keep their KV)
    scope: Literal["all", "tenant"]  # every tenant's prefixes (the admin key), or the caller's own


class StageNode(msgspec.Struct):
    stage: int
    node_id: str  # Ray's id of the node the stage runs on
    address: str  # that node's address


class Health(msgspec.Struct):
    status: Literal["ok", "recovering", "unhealthy"]  # recovering: a failed stage is being replaced
    error: str | None = None  # why it is unhealthy
    stages: list[StageNode] | None = None  # under Ray (--executor ray): where each stage runs now


class Version(msgspec.Struct):
    version: str


class TokenizerInfo(msgspec.Struct):
    """GET /tokenizer_info: what a remote tokenizer needs (vLLM's fields)."""

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None
    model_max_length: int  # the served context (max_model_len)
    max_model_len: int
    vocab_size: int


class Tokenized(msgspec.Struct):
    """POST /tokenize's answer."""

    tokens: list[int]
    count: int
    max_model_len: int


class Detokenized(msgspec.Struct):
    """POST /detokenize's answer."""

    prompt: str


class ChromeTrace(msgspec.Struct):
    """Trace Event Format: one thread per stage, one complete ("X") event per computed plan."""

    traceEvents: list[dict[str, Any]]  # the format's own (camelCase) names
    displayTimeUnit: str


class PipelineInterval(msgspec.Struct):
    """One stage computing one micro-batch."""

    stage: int
    mb_id: int
    kind: Literal["prefill", "decode", "mixed", "unknown"]
    tokens: int  # new tokens in the micro-batch
    prefix: int  # tokens cached before its longest prefill chunk; 0 for decodes
    start: float  # seconds since the epoch, the stage's clock
    end: float


class PipelineView(msgspec.Struct):
    """GET /debug/pipeline: what the playground page draws, in one poll."""

    time: float  # the server's clock (seconds since the epoch): the right edge of the view
    model: str
    pp_size: int
    chat_template: bool  # whether the model has one (chat needs it; without, text is completed as is)
    status: Literal["ok", "recovering", "unhealthy"]  # as /health says it
    error: str | None  # why it is unhealthy
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    stage_busy: list[float]  # per stage: share of the last 10 s spent computing
    intervals: list[PipelineInterval]  # those that ended after `since`, oldest first (the newest 2000)
    kernels: list[StageKernels]  # per stage: the CPU kernels it runs (engine/model/kernel_choice.py)


class WsToken(msgspec.Struct, tag="token"):
    """One generated token; `text` is what it completes ("" while a character is incomplete)."""

    id: str
    token_id: int
    text: str
    logprob: float | None = None  # present when sampling_params.logprobs is set


class WsDone(msgspec.Struct, tag="done"):
    """The request ended (finish_reason "abort" after a cancel)."""

    id: str
    finish_reason: FinishReason
    usage: NativeUsage


class WsError(msgspec.Struct, tag="error"):
    """A bad message or a failed request (id null when the message had no readable id)."""

    id: str | None
    message: str


class WsAuthOk(msgspec.Struct, tag="auth_ok"):
    """The `auth` message carried the key (or none was needed): requests may follow."""


WsEvent = WsToken | WsDone | WsError | WsAuthOk
