"""GET /openapi.json: the whole API as an OpenAPI 3.1 document, for clients and code generators.

Request bodies are generated from the msgspec Structs that the handlers decode with
(server/protocol.py), so the schema cannot drift from what the server accepts, and the sampling
fields' ranges from their one declaration, in SamplingParams; responses from those of
server/responses.py. The fuzz test (tests/test_fuzz.py) checks every answer against
the document. The websocket's messages, which OpenAPI cannot express, are components too, named
from the /ws operation's `x-websocket-messages`.
"""

from __future__ import annotations

import functools
from importlib import metadata
from typing import Any

import msgspec
from aiohttp import web

from ppserve.engine.model.grammar import MAX_CHOICES
from ppserve.scheduler.sampling_params import FIELDS, MAX_LOGIT_BIAS
from ppserve.server.anthropic_api import MessagesRequest
from ppserve.server.app import STATE
from ppserve.server.limits import RequestLimits
from ppserve.server.openai_responses import ResponsesRequest
from ppserve.server.protocol import (
    MAX_N,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    GenerateRequest,
    TokenizeRequest,
    WsMessage,
)
from ppserve.server.responses import (
    AnthropicMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChromeTrace,
    Completion,
    CompletionChunk,
    Detokenized,
    EmbeddingList,
    ErrorResponse,
    FlushCacheResult,
    GenerateChunk,
    GenerateResult,
    Health,
    ModelCard,
    ModelList,
    PipelineView,
    ResponseObject,
    Tokenized,
    TokenizerInfo,
    TypedEvent,
    Version,
    WsEvent,
)
from ppserve.server.tool_calls import MAX_TOOLS

REF = "#/components/schemas/{name}"

# ---- the document -------------------------------------------------------------------------


def _json(name: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": REF.format(name=name)}}}}


def _json_or_sse(name: str, chunk: str, description: str) -> dict[str, Any]:
    """A 200 that is JSON, or server-sent events when the request says `stream: true`."""
    # Before OpenAPI 3.2 (`itemSchema`), the schema of an event stream describes one event, with
    # its `data` as JSON text in `contentSchema` (the convention of OpenAPI 3.2 and of tools).
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [{"$ref": REF.format(name=chunk)}, {"$ref": REF.format(name="ErrorResponse")}]},
    }
    response = _json(name, description)
    response["content"]["text/event-stream"] = {
        "schema": {
            "description": f"one server-sent event: `data: <{chunk}>` per step, then `data: [DONE]`; an error "
            "after the 200 went out is one more event, an ErrorResponse, before [DONE]",
            "type": "object",
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}},
            "required": ["data"],
        }
    }
    return response


def _json_or_events(name: str, description: str) -> dict[str, Any]:
    """A 200 that is JSON, or typed server-sent events (`event: <type>`, `data: <TypedEvent>`, no
    [DONE]) when the request says `stream: true`: the Responses and Messages APIs' streams."""
    response = _json(name, description)
    data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"$ref": REF.format(name="TypedEvent")},
    }
    response["content"]["text/event-stream"] = {
        "schema": {
            "description": "one server-sent event per step, named by its type; an error after the 200 went out is "
            "one more event, of type `error`",
            "type": "object",
            "properties": {"event": {"type": "string"}, "data": data},
            "required": ["event", "data"],
        }
    }
    return response


_ERRORS = {
    400: "malformed JSON, a field of the wrong type or out of range, an unknown model, a prompt too long",
    401: "the server has an API key and `Authorization: Bearer <key>` is missing or wrong",
    403: "a foreign `Host` on a loopback-bound server, or a websocket from a foreign `Origin`",
    413: "the body is over the size limit (16 MiB by default)",
    404: "no such model (or path)",
    415: "the body is not sent as `Content-Type: application/json`",
    503: "the queue is full, the engine is dead, or the server is shutting down",
}


def _errors(*codes: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for code in codes:
        out[str(code)] = _json("ErrorResponse", _ERRORS[code])
        if code == 503:
            out["503"]["headers"] = {
                "Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}
            }
    return out


def _op(
    operation_id: str,
    tag: str,
    summary: str,
    responses: dict[str, Any],
    *,
    body: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    op = {"operationId": operation_id, "tags": [tag], "summary": summary, **(extra or {}), "responses": responses}
    if body is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF.format(name=body)}}},
        }
    return op


_WS = """JSON text messages. The client sends WsMessage (`generate` or `chat` with an id it chooses, unique
among its open requests, or `cancel`); the server answers WsEvent: `token` events, then one `done`
(finish_reason `abort` after a cancel), or an `error`. The socket stays open after errors. `chat` renders
its messages with the model's chat template, as /v1/chat/completions does. A client that cannot send
the Authorization header (a browser) opens the socket without it and sends `auth` with the key as its
first message, answered `auth_ok`; a wrong key, another first message, or none within 10 s gets an
`error` and the close code 4401."""
_WS_MESSAGES = {"client": {"$ref": REF.format(name="WsMessage")}, "server": {"$ref": REF.format(name="WsEvent")}}
OPEN: dict[str, Any] = {"security": []}  # no API key needed


def _paths() -> dict[str, Any]:
    generation_errors = _errors(400, 401, 403, 413, 415, 503)
    return {
        "/v1/completions": {
            "post": _op(
                "createCompletion",
                "openai",
                "Complete one prompt or several (OpenAI-compatible)",
                {"200": _json_or_sse("Completion", "CompletionChunk", "n choices per prompt"), **generation_errors},
                body="CompletionRequest",
            )
        },
        "/v1/chat/completions": {
            "post": _op(
                "createChatCompletion",
                "openai",
                "Answer a conversation, rendered with the model's chat template (OpenAI-compatible)",
                {"200": _json_or_sse("ChatCompletion", "ChatCompletionChunk", "n choices"), **generation_errors},
                body="ChatRequest",
            )
        },
        "/v1/responses": {
            "post": _op(
                "createResponse",
                "openai",
                "One assistant turn through OpenAI's Responses API (stateless: nothing is stored)",
                {"200": _json_or_events("ResponseObject", "the response"), **generation_errors},
                body="ResponsesRequest",
            )
        },
        "/v1/messages": {
            "post": _op(
                "createMessage",
                "anthropic",
                "One assistant turn through Anthropic's Messages API (the key as x-api-key or a bearer token)",
                {"200": _json_or_events("AnthropicMessage", "the message"), **generation_errors},
                body="MessagesRequest",
            )
        },
        "/v1/embeddings": {
            "post": _op(
                "createEmbedding",
                "openai",
                "Embed inputs: the last token's final hidden state, L2-normalized (OpenAI-compatible)",
                {"200": _json("EmbeddingList", "a vector per input"), **generation_errors},
                body="EmbeddingRequest",
            )
        },
        "/v1/models": {
            "get": _op(
                "listModels",
                "openai",
                "The served model and its context length",
                {"200": _json("ModelList", "one model"), **_errors(401)},
            )
        },
        "/v1/models/{model}": {
            "get": _op(
                "retrieveModel",
                "openai",
                "The served model's card; 404 for another name",
                {"200": _json("ModelCard", "the model"), **_errors(401, 404)},
                extra={"parameters": [_MODEL]},
            )
        },
        "/version": {
            "get": _op(
                "version",
                "operations",
                "The server's version (no API key needed)",
                {"200": _json("Version", "the version")},
                extra=OPEN,
            )
        },
        "/tokenizer_info": {
            "get": _op(
                "tokenizerInfo",
                "tokenizer",
                "The tokenizer's special tokens, chat template and context length (vLLM's fields)",
                {"200": _json("TokenizerInfo", "the tokenizer"), **_errors(401, 503)},
            )
        },
        "/tokenize": {
            "post": _op(
                "tokenize",
                "tokenizer",
                "Token ids of a prompt, or of chat messages as the chat template renders them",
                {"200": _json("Tokenized", "the token ids"), **_errors(400, 401, 413, 415, 503)},
                body="TokenizeRequest",
            )
        },
        "/detokenize": {
            "post": _op(
                "detokenize",
                "tokenizer",
                "The text of token ids, special tokens kept",
                {"200": _json("Detokenized", "the text"), **_errors(400, 401, 413, 415, 503)},
                body="DetokenizeRequest",
            )
        },
        "/generate": {
            "post": _op(
                "generate",
                "native",
                "Generate from text or token ids; answers text and token ids",
                {"200": _json_or_sse("GenerateResult", "GenerateChunk", "the generation"), **generation_errors},
                body="GenerateRequest",
            )
        },
        "/ws": {
            "get": _op(
                "websocket",
                "native",
                "Websocket: several generations at once on one connection, with cancel",
                {
                    "101": {"description": "switching to the websocket protocol"},
                    "400": _json("ErrorResponse", "not a websocket handshake"),
                    **_errors(401, 403),
                },
                extra={"description": " ".join(_WS.split()), "x-websocket-messages": _WS_MESSAGES},
            )
        },
        "/health": {
            "get": _op(
                "health",
                "operations",
                "Liveness and readiness (no API key needed)",
                {
                    "200": _json("Health", "the server can take requests"),
                    "503": _json(
                        "Health",
                        "recovering (a failed stage is being replaced; requests wait), or unhealthy: the "
                        "engine is dead, starting or shutting down",
                    ),
                },
                extra=OPEN,
            )
        },
        "/metrics": {
            "get": _op(
                "metrics",
                "operations",
                "Prometheus metrics (with an API key set, it needs the key unless --metrics-public)",
                {
                    "200": _text("text/plain", "Prometheus text exposition format 0.0.4", {"type": "string"}),
                    **_errors(401),
                },
            )
        },
        "/debug/pipeline": {
            "get": _op(
                "pipeline",
                "operations",
                "What the playground draws: health, queue, KV cache, stage busy shares and recent compute intervals",
                {
                    "200": _json("PipelineView", "the pipeline now"),
                    "400": _json("ErrorResponse", "`since` is not a number"),
                    **_errors(401, 503),
                },
                extra={"parameters": [_SINCE]},
            )
        },
        "/": {
            "get": _op(
                "playground",
                "operations",
                "The playground: a page to chat with the model and watch the pipeline (no API key needed to load "
                "it; absent with --no-playground)",
                {"200": _text("text/html", "the page", {"type": "string"})},
                extra=OPEN,
            )
        },
        "/debug/timeline": {
            "get": _op(
                "timeline",
                "operations",
                "Recent per-stage compute intervals as Chrome trace JSON (open it in Perfetto)",
                {"200": _json("ChromeTrace", "the trace"), **_errors(401, 503)},
            )
        },
        "/flush_cache": {
            "post": _op(
                "flushCache",
                "operations",
                "Forget cached prompt prefixes, so the next requests compute theirs again (requests running keep "
                "their KV): every tenant's with the admin key (--admin-key), a tenant's own with its API key; a "
                "server with neither refuses it (403)",
                {"200": _json("FlushCacheResult", "the cache is empty"), **_errors(401, 403, 415, 503)},
            )
        },
        "/openapi.json": {
            "get": _op(
                "openapi",
                "operations",
                "This document (no API key needed)",
                {"200": _text("application/json", "OpenAPI 3.1", {"type": "object"})},
                extra=OPEN,
            )
        },
    }


_MODEL = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
_SINCE = {
    "name": "since",
    "in": "query",
    "required": False,
    "description": "only intervals that ended after this time (seconds since the epoch); absent: all kept. Ask "
    "with the smallest, over the stages, of the newest `end` seen per stage, and drop what is not newer per "
    "stage: each stage's intervals arrive in the order they ran, so nothing is missed",
    "schema": {"type": "number"},
}


def _text(media_type: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {media_type: {"schema": schema}}}


# What the handlers, SamplingParams and the server's RequestLimits check beyond the Structs'
# types, per field and JSON type. Applied only where the Struct's own schema says nothing
# (msgspec Meta constraints win).
_IDS = {"integer": {"minimum": 0}, "array": {"minItems": 1}}
_RANGES: dict[str, dict[str, dict[str, Any]]] = {
    "n": {"integer": {"minimum": 1, "maximum": MAX_N}},
    "text": {"string": {"minLength": 1}},
    "input_ids": _IDS,
    # An OpenAI field taken for compatibility, only when empty:
    "suffix": {"string": {"maxLength": 0}},
    "logit_bias": {"object": {"maxProperties": MAX_LOGIT_BIAS}},
    "tools": {"array": {"minItems": 1, "maxItems": MAX_TOOLS}},
    "choice": {"array": {"minItems": 1, "maxItems": MAX_CHOICES}},
}
# OpenAI's names for fields of SamplingParams that the API spells otherwise.
_SAMPLING_ALIASES = {"max_completion_tokens": "max_tokens", "top_logprobs": "logprobs"}


def _sampling_ranges() -> dict[str, dict[str, dict[str, Any]]]:
    """Each sampling field's range, generated from its declaration in SamplingParams: the JSON
    Schema that msgspec makes of one value's constrained type, keyed by its JSON type (so that
    chat's boolean `logprobs` is left alone)."""
    ranges: dict[str, dict[str, dict[str, Any]]] = {}
    for spec in FIELDS:
        schema = msgspec.json.schema(spec.value_type)
        ranges[spec.name] = {schema.pop("type"): schema}
    for alias, name in _SAMPLING_ALIASES.items():
        ranges[alias] = ranges[name]
    return ranges


# Chat content as a list of parts: text parts only.
_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}


def _limits(limits: RequestLimits) -> dict[str, dict[str, dict[str, Any]]]:
    """_RANGES and the sampling fields' plus the server's limits on lists and strings (server/limits.py)."""
    sampling = _sampling_ranges()
    return {
        **sampling,
        **_RANGES,
        "stop": {
            "string": {**sampling["stop"]["string"], "maxLength": limits.max_stop_chars},
            "array": {"maxItems": limits.max_stop},
        },
        "stop_token_ids": {**sampling["stop_token_ids"], "array": {"maxItems": limits.max_stop_token_ids}},
        "messages": {"array": {"minItems": 1, "maxItems": limits.max_messages}},
    }


def _components(limits: RequestLimits) -> dict[str, Any]:
    requests: list[Any] = [CompletionRequest, ChatRequest, GenerateRequest, TokenizeRequest, DetokenizeRequest]
    requests += [EmbeddingRequest, ResponsesRequest, MessagesRequest]
    responses: list[Any] = [
        ErrorResponse,
        *(Completion, CompletionChunk, ChatCompletion, ChatCompletionChunk, ModelList),
        *(GenerateResult, GenerateChunk, Health, FlushCacheResult, ChromeTrace, PipelineView),
        *(TokenizerInfo, Tokenized, Detokenized, ModelCard, Version, EmbeddingList),
        *(ResponseObject, AnthropicMessage, TypedEvent),
    ]
    (*_, ws_message, ws_event), schemas = msgspec.json.schema_components(
        [*requests, *responses, WsMessage, WsEvent], ref_template=REF
    )
    schemas["WsMessage"] = ws_message  # the unions have no name of their own
    schemas["WsEvent"] = ws_event
    bodies = ["CompletionRequest", "ChatRequest", "GenerateRequest", "WsGenerate", "WsChat", "WsCancel", "WsAuth"]
    bodies += ["TokenizeRequest", "DetokenizeRequest", "EmbeddingRequest", "ResponsesRequest", "MessagesRequest"]
    ranges = _limits(limits)
    for name in (*bodies, "NativeSampling"):
        for field, prop in schemas[name]["properties"].items():
            _limit(prop, ranges.get(field, {}))
    # `prompt` is `Any` in the Struct (its four forms are told apart by `prompts()`); give its real union.
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    schemas["CompletionRequest"]["properties"]["prompt"] = {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
            ids,
            {"type": "array", "items": ids, "minItems": 1},
        ],
        "description": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    }
    for branch in schemas["ChatMessage"]["properties"]["content"]["anyOf"]:
        if branch.get("type") == "array":
            branch["items"] = _TEXT_PART
            branch["maxItems"] = limits.max_content_parts
    # /generate takes exactly one of `text` and `input_ids` (the other absent or null).
    for name in ("GenerateRequest", "WsGenerate"):
        schemas[name]["anyOf"] = [
            {"required": [given], "properties": {given: {"not": {"type": "null"}}, other: {"type": "null"}}}
            for given, other in (("text", "input_ids"), ("input_ids", "text"))
        ]
    # `decode()` treats a null as absent, at the top level and in sampling_params, so every
    # optional field there takes null.
    for name in (*bodies, "NativeSampling"):
        schema = schemas[name]
        for field, prop in schema["properties"].items():
            if field not in schema.get("required", []) and not _nullable(prop):
                schema["properties"][field] = _with_null(prop)
    return schemas


def _limit(schema: dict[str, Any], limits: dict[str, dict[str, Any]]) -> None:
    """Add `limits[type]` to every node of `schema` of that JSON type (through anyOf and items)."""
    for key, value in limits.get(schema.get("type", ""), {}).items():
        schema.setdefault(key, value)
    for branch in schema.get("anyOf", []):
        _limit(branch, limits)
    if isinstance(schema.get("items"), dict):
        _limit(schema["items"], limits)


def _nullable(prop: dict[str, Any]) -> bool:
    return prop.get("type") == "null" or any(p.get("type") == "null" for p in prop.get("anyOf", []))


def _with_null(prop: dict[str, Any]) -> dict[str, Any]:
    """`prop` or null, keeping its annotations (default, description) at the top."""
    annotations = {k: v for k, v in prop.items() if k in ("default", "description", "title")}
    schema = {k: v for k, v in prop.items() if k not in annotations}
    return {"anyOf": [schema, {"type": "null"}], **annotations}


def _version() -> str:
    try:
        return metadata.version("ppserve")
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "0.0.0"


def openapi_schema(limits: RequestLimits | None = None) -> dict[str, Any]:
    """The document, a copy of its own; of the server's settings, only its limits (default:
    RequestLimits()) show in it."""
    document: dict[str, Any] = msgspec.json.decode(_document(limits or RequestLimits()))
    return document


@functools.cache
def _document(limits: RequestLimits) -> bytes:
    return msgspec.json.encode(_build(limits))


def _build(limits: RequestLimits) -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "ppserve",
            "version": _version(),
            "description": "Pipeline-parallel LLM serving: an OpenAI-compatible API, a native /generate, "
            "and a websocket. Errors are ErrorResponse, with the field at fault in `param`. "
            "A server started with an API key wants `Authorization: Bearer <key>` on every "
            "operation but /, /health and /openapi.json (and /metrics with --metrics-public); the websocket "
            "also takes the key as its first message.",
        },
        "paths": _paths(),
        "components": {
            "schemas": _components(limits),
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearerAuth": []}],
    }


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=_document(request.app[STATE].options.limits), content_type="application/json")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/openapi.json", openapi)
