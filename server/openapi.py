"""GET /openapi.json: the whole API as an OpenAPI 3.1 document, for clients and code generators.

Request bodies are generated from the msgspec Structs that the handlers decode with
(server/protocol.py), so the schema cannot drift from what the server accepts, and the sampling
fields' ranges from their one declaration, in SamplingParams; responses from those of
server/responses.py. The fuzz test (tests/server/test_fuzz.py) checks every answer against
the document. The websocket's messages, which OpenAPI cannot express, are components too, named
from the /ws operation's `x-websocket-messages`.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
from aiohttp import web

from ppserve.engine.model.grammar import MAX_CHOICES
from ppserve.scheduler.sampling_params import FIELDS, MAX_LOGIT_BIAS
from ppserve.server.anthropic_api import MessagesRequest
from ppserve.server.limits import RequestLimits
from ppserve.server.openai_responses import ResponsesRequest
from ppserve.server.openapi_paths import REF, paths
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
from ppserve.server.state import STATE
from ppserve.server.tool_calls import MAX_TOOLS
from ppserve.server.version import installed_version

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
            "version": installed_version(),
            "description": "Pipeline-parallel LLM serving: an OpenAI-compatible API, a native /generate, "
            "and a websocket. Errors are ErrorResponse, with the field at fault in `param`. "
            "A server started with an API key wants `Authorization: Bearer <key>` (or `x-api-key: <key>`) "
            "on every operation but /, /health, /version and /openapi.json (and /metrics with "
            "--metrics-public); the websocket also takes the key as its first message.",
        },
        "paths": paths(),
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
