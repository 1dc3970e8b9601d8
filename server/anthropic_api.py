"""POST /v1/messages: Anthropic's Messages API, so that clients and agent tools written for it run
against this server.

`system` (text or text blocks), `messages` with text, `tool_use` and `tool_result` blocks,
`max_tokens` (required, as Anthropic requires it), `stop_sequences`, `temperature`, `top_p`,
`top_k`, `tools` with `tool_choice` (auto, any, tool, none), `output_config.format` (a JSON
schema the reply follows), and `stream` with Anthropic's events (`message_start`,
`content_block_start`, `content_block_delta`, ... `message_stop`). The key may come as
`x-api-key` (Anthropic's clients send it) or as a bearer token (server/security.py). The request
becomes a chat turn (server/chat_turn.py); stop reasons are Anthropic's: end_turn, max_tokens,
stop_sequence, tool_use.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Annotated, Any, Literal

import msgspec
from aiohttp import web

from ppserve.scheduler.sampling_params import TokenCount
from ppserve.server.chat_turn import Reply, Turn
from ppserve.server.errors import ApiError
from ppserve.server.limits import decode_request
from ppserve.server.protocol import ChatRequest, ShortText
from ppserve.server.state import STATE
from ppserve.server.streams import sse_response

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


class Message(msgspec.Struct):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class Tool(msgspec.Struct, kw_only=True):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: str | None = None  # "custom", or absent; Anthropic's own server tools are not served


class OutputFormat(msgspec.Struct, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, kw_only=True):
    format: OutputFormat | None = None
    effort: str | None = None  # how hard a reasoning model thinks: nothing to steer here


class MessagesRequest(msgspec.Struct, kw_only=True):
    """Anthropic's fields; `metadata`, `thinking` and `service_tier` are accepted and change nothing."""

    max_tokens: TokenCount
    messages: list[Message]
    model: ShortText | None = None
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None  # Anthropic's range
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Tool] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the earlier form of output_config.format
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None

    def chat(self) -> ChatRequest:
        """The same turn as a chat request (ApiError naming this API's field where it cannot be)."""
        if not self.messages:
            raise ApiError(400, "messages must not be empty", "messages")
        system = [] if self.system is None else [{"role": "system", "content": _text(self.system, "system")}]
        chat: dict[str, Any] = {"messages": system + [m for msg in self.messages for m in _chat_messages(msg)]}
        chat["max_tokens"] = self.max_tokens
        for name in ("temperature", "top_p", "top_k", "model"):
            if (value := getattr(self, name)) is not None:
                chat[name] = value
        if self.stop_sequences:
            chat["stop"] = self.stop_sequences
        if self.tools is not None:  # [] too: a 400, as chat answers it
            if bad := [t.type for t in self.tools if t.type not in (None, "custom")]:
                raise ApiError(400, f"only custom tools are supported, not {bad[0]!r}", "tools")
            chat["tools"] = [_tool(t) for t in self.tools]
        if self.tool_choice is not None:
            chat["tool_choice"], parallel = _tool_choice(self.tool_choice)
            chat["parallel_tool_calls"] = parallel
        fmt = self.output_config.format if self.output_config and self.output_config.format else self.output_format
        if fmt is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema}}
        try:
            return msgspec.convert(chat, ChatRequest)
        except msgspec.ValidationError as e:
            raise ApiError(400, f"invalid request: {e}", "messages") from None


def _text(content: str | list[dict[str, Any]], field: str) -> str:
    """Text, or text blocks joined."""
    if isinstance(content, str):
        return content
    if any(not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str) for b in content):
        raise ApiError(400, f"{field}: only text blocks are supported here", field)
    return "".join(b["text"] for b in content)


def _chat_messages(message: Message) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become tool messages (first, as they
    answer the calls before them), tool_use blocks the assistant's calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts, calls, results = [], [], []
    for block in message.content:
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and message.role == "assistant":
            arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
            calls.append({"id": block.get("id"), "function": {"name": block.get("name"), "arguments": arguments}})
        elif kind == "tool_result" and message.role == "user":
            content = block.get("content", "")
            if not isinstance(content, (str, list)):
                raise ApiError(400, "a tool_result's content must be text or text blocks", "messages")
            text = content if isinstance(content, str) else _text(content, "messages")
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
        else:
            raise ApiError(400, f"{message.role} messages cannot hold {kind!r} blocks here", "messages")
    out = results
    if calls:
        out.append({"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls})
    elif texts or not results:
        out.append({"role": message.role, "content": "".join(texts)})
    return out


def _tool(tool: Tool) -> dict[str, Any]:
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any]) -> tuple[str | dict[str, Any], bool]:
    """Chat's tool_choice, and whether several calls may come at once."""
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise ApiError(400, 'tool_choice type must be "auto", "any", "none", or "tool" with a name', "tool_choice")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)


async def messages(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await decode_request(await request.read(), MessagesRequest, state.options.limits)
    rid = f"msg_{uuid.uuid4().hex}"
    turn = await Turn.start(request, body.chat(), rid)
    model = state.options.served_model_name
    if not body.stream:
        return web.json_response(_message(rid, model, await turn.reply(), turn.prompt_tokens))
    return await sse_response(request, _events(rid, model, turn), _error)


def _blocks(reply: Reply) -> list[dict[str, Any]]:
    if not reply.calls:
        return [{"type": "text", "text": reply.text}]
    return [_tool_use(c, json.loads(c["function"]["arguments"])) for c in reply.calls]


def _tool_use(call: dict[str, Any], arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": arguments}  # fmt: skip


def _stop(reply: Reply) -> dict[str, Any]:
    reason = "stop_sequence" if reply.stop_sequence is not None else _STOP_REASONS[reply.finish]
    return {"stop_reason": reason, "stop_sequence": reply.stop_sequence}


def _message(rid: str, model: str, reply: Reply | None, prompt_tokens: int) -> dict[str, Any]:
    """The message: whole, or (reply None) as `message_start` opens it."""
    usage = {
        "input_tokens": prompt_tokens - (reply.cached_tokens if reply else 0),
        "output_tokens": reply.completion_tokens if reply else 0,
        "cache_read_input_tokens": reply.cached_tokens if reply else 0,
        "cache_creation_input_tokens": 0,
    }
    stop = _stop(reply) if reply is not None else {"stop_reason": None, "stop_sequence": None}
    content = _blocks(reply) if reply is not None else []
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content, **stop,
            "usage": usage}  # fmt: skip


def _error(e: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": e.type, "message": e.message}}


async def _events(rid: str, model: str, turn: Turn) -> AsyncGenerator[dict[str, Any], None]:
    yield {"type": "message_start", "message": _message(rid, model, None, turn.prompt_tokens)}
    opened = False  # the text block (sent with the first text)
    reply: Reply | None = None
    async with aclosing(turn.deltas()) as items:
        async for item in items:
            if isinstance(item, Reply):
                reply = item
                break
            if not opened:
                opened = True
                yield {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
            yield {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": item}}
    assert reply is not None
    if reply.calls:
        for k, call in enumerate(reply.calls):
            args = call["function"]["arguments"]
            yield {"type": "content_block_start", "index": k, "content_block": _tool_use(call, {})}
            yield {
                "type": "content_block_delta",
                "index": k,
                "delta": {"type": "input_json_delta", "partial_json": args},
            }
            yield {"type": "content_block_stop", "index": k}
    else:
        if not opened:  # no text at all: the block still opens and closes
            yield {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
        yield {"type": "content_block_stop", "index": 0}
    usage = {"output_tokens": reply.completion_tokens}
    yield {"type": "message_delta", "delta": _stop(reply), "usage": usage}
    yield {"type": "message_stop"}
