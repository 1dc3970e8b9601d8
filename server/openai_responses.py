"""POST /v1/responses: OpenAI's Responses API, stateless.

`input` (a string, or items: messages with text content, earlier `function_call`s and their
`function_call_output`s), `instructions` (a system message first), `max_output_tokens`,
`temperature`, `top_p`, `text.format` (text, json_object, json_schema with `strict`), function
`tools` with `tool_choice` and `parallel_tool_calls`, and `stream` with the typed events
(`response.created` ... `response.output_text.delta` ... `response.completed`). The request
becomes a chat turn (server/chat_turn.py); the answer's `output` is one message, or the calls.

Nothing is stored: `store` is answered false, and `previous_response_id` (which needs the stored
conversation) is refused; a client sends the whole conversation as `input` instead.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any, Literal

import msgspec
from aiohttp import web

from ppserve.scheduler.sampling_params import TokenCount
from ppserve.server.chat_turn import Reply, Turn
from ppserve.server.errors import ApiError
from ppserve.server.limits import decode_request
from ppserve.server.protocol import ChatRequest, ShortText
from ppserve.server.state import STATE
from ppserve.server.streams import sse_response


class TextFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: ShortText | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """OpenAI's fields for the Responses API; those that only steer OpenAI's own service (`include`,
    `reasoning`, `truncation`, `service_tier`, ...) are accepted and change nothing."""

    input: str | list[dict[str, Any]]
    model: ShortText | None = None
    instructions: str | None = None
    max_output_tokens: TokenCount | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    store: bool | None = None
    previous_response_id: ShortText | None = None
    metadata: dict[str, str] | None = None
    user: ShortText | None = None

    def chat(self) -> ChatRequest:
        """The same turn as a chat request (ApiError naming this API's field where it cannot be)."""
        if self.previous_response_id is not None:
            raise ApiError(
                400, "previous_response_id is not supported: nothing is stored; send the conversation as input",
                "previous_response_id",
            )  # fmt: skip
        chat: dict[str, Any] = {"messages": _messages(self.instructions, self.input)}
        if self.max_output_tokens is not None:
            chat["max_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p", "model"):
            if (value := getattr(self, name)) is not None:
                chat[name] = value
        if self.tools is not None:  # [] too: a 400, as chat answers it
            chat["tools"] = [_tool(t) for t in self.tools]
            chat["parallel_tool_calls"] = self.parallel_tool_calls
        if self.tool_choice is not None:
            chat["tool_choice"] = _tool_choice(self.tool_choice)
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.schema is None:
                raise ApiError(400, "text.format json_schema needs a schema", "text")
            spec = {"name": fmt.name or "response", "schema": fmt.schema, "strict": fmt.strict}
            chat["response_format"] = {"type": "json_schema", "json_schema": spec}
        try:
            return msgspec.convert(chat, ChatRequest)
        except msgspec.ValidationError as e:
            raise ApiError(400, f"invalid request: {e}", "input") from None


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or parts of type input_text / output_text / text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of text parts", "input")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            raise ApiError(400, f"{where}: only text content parts are supported", "input")
        if not isinstance(text := part.get("text"), str):
            raise ApiError(400, f"{where}: a text part needs its text", "input")
        parts.append(text)
    return "".join(parts)


def _messages(instructions: str | None, items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages of the Responses input: consecutive function calls make one assistant message."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    for i, item in enumerate(items):
        kind, where = item.get("type", "message"), f"input[{i}]"
        if kind == "message" and "role" in item:
            out.append({"role": item["role"], "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1]["content"]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, where)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        else:
            raise ApiError(400, f"{where}: items of type {kind!r} are not supported", "input")
    return out


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise ApiError(400, f"only function tools are supported, not {tool.get('type')!r}", "tools")
    fields = ("name", "description", "parameters", "strict")
    return {"type": "function", "function": {k: tool[k] for k in fields if tool.get(k) is not None}}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ApiError(400, 'tool_choice must be "none", "auto", "required" or a function by name', "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", responses)


async def responses(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await decode_request(await request.read(), ResponsesRequest, state.options.limits)
    rid = f"resp_{uuid.uuid4().hex}"
    turn = await Turn.start(request, body.chat(), rid)
    answer = _Answer(body, rid, state.options.served_model_name)
    if not body.stream:
        return web.json_response(answer.response(await turn.reply()))
    return await sse_response(request, answer.events(turn), answer.error)


class _Answer:
    """The response object and its stream events, for one request."""

    def __init__(self, body: ResponsesRequest, rid: str, model: str) -> None:
        self.body, self.rid, self.model = body, rid, model
        self.created = int(time.time())
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.sequence = 0

    def response(self, reply: Reply | None) -> dict[str, Any]:
        """The response object: in progress (reply None), or complete."""
        b = self.body
        status, incomplete = "in_progress", None
        if reply is not None:
            status = "incomplete" if reply.finish == "length" else "completed"
            incomplete = {"reason": "max_output_tokens"} if reply.finish == "length" else None
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": self.output(reply) if reply is not None else [],
            "output_text": reply.text if reply is not None else "",
            "incomplete_details": incomplete,
            "error": None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "text": msgspec.to_builtins(b.text) if b.text else {"format": {"type": "text"}},
            "tools": b.tools or [],
            "tool_choice": b.tool_choice or "auto",
            "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": None,
            "store": False,
            "metadata": b.metadata or {},
            "usage": self.usage(reply) if reply is not None else None,
        }

    @staticmethod
    def usage(reply: Reply) -> dict[str, Any]:
        return {
            "input_tokens": reply.prompt_tokens,
            "input_tokens_details": {"cached_tokens": reply.cached_tokens},
            "output_tokens": reply.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        }

    def output(self, reply: Reply) -> list[dict[str, Any]]:
        if reply.calls:
            return [self.call(c, "completed") for c in reply.calls]
        return [self.message(reply.text, "completed" if reply.finish != "length" else "incomplete")]

    def message(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [self.part(text)]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def call(call: dict[str, Any], status: str, arguments: str | None = None) -> dict[str, Any]:
        f = call["function"]
        args = f["arguments"] if arguments is None else arguments
        fid = "fc_" + call["id"].removeprefix("call_")
        return {"type": "function_call", "id": fid, "call_id": call["id"], "name": f["name"], "arguments": args,
                "status": status}  # fmt: skip

    def error(self, e: ApiError) -> dict[str, Any]:
        """The stream's `error` event, when the turn fails after the stream began."""
        return self.event("error", code=e.type, message=e.message, param=e.param)

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    async def events(self, turn: Turn) -> AsyncGenerator[dict[str, Any], None]:
        yield self.event("response.created", response=self.response(None))
        yield self.event("response.in_progress", response=self.response(None))
        at = {"item_id": self.message_id, "output_index": 0}
        opened = False  # the message item and its text part (sent with the first text)
        reply: Reply | None = None
        async with aclosing(turn.deltas()) as items:
            async for item in items:
                if isinstance(item, Reply):
                    reply = item
                    break
                if not opened:
                    opened = True
                    yield self.event(
                        "response.output_item.added", output_index=0, item=self.message(None, "in_progress")
                    )
                    yield self.event("response.content_part.added", **at, content_index=0, part=self.part(""))
                yield self.event("response.output_text.delta", **at, content_index=0, delta=item, logprobs=[])
        assert reply is not None
        if reply.calls:
            for k, call in enumerate(reply.calls):
                fid = self.call(call, "")["id"]
                yield self.event("response.output_item.added", output_index=k, item=self.call(call, "in_progress", ""))
                args = call["function"]["arguments"]
                yield self.event("response.function_call_arguments.delta", item_id=fid, output_index=k, delta=args)
                yield self.event("response.function_call_arguments.done", item_id=fid, output_index=k, arguments=args,
                                 name=call["function"]["name"])  # fmt: skip
                yield self.event("response.output_item.done", output_index=k, item=self.call(call, "completed"))
        else:
            if not opened:  # no text at all: the message still opens and closes
                yield self.event("response.output_item.added", output_index=0, item=self.message(None, "in_progress"))
                yield self.event("response.content_part.added", **at, content_index=0, part=self.part(""))
            yield self.event("response.output_text.done", **at, content_index=0, text=reply.text, logprobs=[])
            yield self.event("response.content_part.done", **at, content_index=0, part=self.part(reply.text))
            done = self.output(reply)[0]
            yield self.event("response.output_item.done", output_index=0, item=done)
        final = self.response(reply)
        yield self.event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                         response=final)  # fmt: skip
