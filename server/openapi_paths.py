"""The paths of the OpenAPI document (server/openapi.py): each operation, its body and answers.

A request body names its component (a msgspec Struct of server/protocol.py, generated there);
an answer is JSON, or JSON or server-sent events for the operations that stream.
"""

from __future__ import annotations

from typing import Any

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


def _generation_errors() -> dict[str, Any]:
    return _errors(400, 401, 403, 413, 415, 503)


def paths() -> dict[str, Any]:
    """Every path of the API, by family."""
    return {**_generation_paths(), **_model_and_token_paths(), **_service_paths()}


def _generation_paths() -> dict[str, Any]:
    return {
        "/v1/completions": {
            "post": _op(
                "createCompletion",
                "openai",
                "Complete one prompt or several (OpenAI-compatible)",
                {"200": _json_or_sse("Completion", "CompletionChunk", "n choices per prompt"), **_generation_errors()},
                body="CompletionRequest",
            )
        },
        "/v1/chat/completions": {
            "post": _op(
                "createChatCompletion",
                "openai",
                "Answer a conversation, rendered with the model's chat template (OpenAI-compatible)",
                {"200": _json_or_sse("ChatCompletion", "ChatCompletionChunk", "n choices"), **_generation_errors()},
                body="ChatRequest",
            )
        },
        "/v1/responses": {
            "post": _op(
                "createResponse",
                "openai",
                "One assistant turn through OpenAI's Responses API (stateless: nothing is stored)",
                {"200": _json_or_events("ResponseObject", "the response"), **_generation_errors()},
                body="ResponsesRequest",
            )
        },
        "/v1/messages": {
            "post": _op(
                "createMessage",
                "anthropic",
                "One assistant turn through Anthropic's Messages API (the key as x-api-key or a bearer token)",
                {"200": _json_or_events("AnthropicMessage", "the message"), **_generation_errors()},
                body="MessagesRequest",
            )
        },
        "/v1/embeddings": {
            "post": _op(
                "createEmbedding",
                "openai",
                "Embed inputs: the last token's final hidden state, L2-normalized (OpenAI-compatible)",
                {"200": _json("EmbeddingList", "a vector per input"), **_generation_errors()},
                body="EmbeddingRequest",
            )
        },
    }


def _model_and_token_paths() -> dict[str, Any]:
    return {
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
                {"200": _json_or_sse("GenerateResult", "GenerateChunk", "the generation"), **_generation_errors()},
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
    }


def _service_paths() -> dict[str, Any]:
    return {
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
