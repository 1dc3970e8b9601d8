"""The native API: POST /generate (text or token ids in, text and token ids out) and GET /ws,
a websocket that streams several requests at once.

Websocket protocol (JSON text messages):
    -> {"type": "generate", "id": "a", "text": "Hello", "sampling_params": {"max_tokens": 8}}
    -> {"type": "chat", "id": "b", "messages": [{"role": "user", "content": "Hi"}], "sampling_params": {...}}
    -> {"type": "cancel", "id": "a"}
    -> {"type": "auth", "api_key": "..."}
    <- {"type": "token", "id": "a", "token_id": 42, "text": " world"}   one per generated token
    <- {"type": "done", "id": "a", "finish_reason": "length", "usage": {...}}
    <- {"type": "error", "id": "a" | null, "message": "..."}            the socket stays open
    <- {"type": "auth_ok"}
`chat` renders its messages with the model's chat template, as /v1/chat/completions does, and
streams like `generate`. `text` of a token event is the text that token completes; it is ""
while a multi-byte character or a possible stop string is still incomplete. Ids are 1 to 256
characters (each request's events repeat its id).

Authentication: with an API key, a client sends it as `Authorization: Bearer <key>` on the
upgrade, or, if it cannot set headers (a browser), as its first message, `auth`. A socket
opened without the header must send `auth` with the right key within AUTH_TIMEOUT_S and before
anything else; otherwise it gets an error event and is closed with code 4401. A later `auth`
is answered `auth_ok` if its key is right (always, on a server without a key), else with an error
event; the socket stays open either way. The socket's requests belong to the tenant of the last
key it proved (server/tenants.py), and `generate` and `chat` take a `cache_salt` and
`speculative_usage` as /generate does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, Hashable
from contextlib import aclosing
from typing import Any

from aiohttp import WSMsgType, web

from ppserve.engine.outputs import RequestOutput
from ppserve.server import tokens
from ppserve.server.errors import ApiError, clip_message
from ppserve.server.json_body import decode_ws_async, peek_id
from ppserve.server.limits import check_limits, decode_request
from ppserve.server.protocol import DEFAULT_MAX_TOKENS, GenerateRequest, WsAuth, WsCancel, WsChat
from ppserve.server.security import bearer_token
from ppserve.server.state import STATE, TENANT, ServerState, client_key, client_of
from ppserve.server.streams import Collected, Stream, collect, merge, speculative_usage, sse_response
from ppserve.server.tenants import Tenant

log = logging.getLogger("ppserve.server")
AUTH_TIMEOUT_S = 10.0  # a socket without the key is closed this soon, so none is held open without it
UNAUTHORIZED = 4401  # close code: the application range (4000-4999), with HTTP's 401 in it
AUTH_ERROR = (
    'missing or wrong API key (send {"type": "auth", "api_key": "<key>"} as the first message, '
    f"within {AUTH_TIMEOUT_S:.0f} s, or the header 'Authorization: Bearer <key>')"
)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate)
    app.router.add_get("/ws", websocket)


async def _submit(
    state: ServerState, body: GenerateRequest | WsChat, request_id: str, tenant: Tenant | None, client: Hashable
) -> Stream:
    salt = state.cache_salt(tenant, body.cache_salt)  # before any tokenizing: a refusal costs nothing
    default: int | None = DEFAULT_MAX_TOKENS
    if isinstance(body, WsChat):
        ids = await tokens.encode_chat(state.ready.tokenizer, body.chat_messages(), True, state.config.max_model_len)
        default = None  # as /v1/chat/completions: the rest of the context
    else:
        ids = await state.encode(body.prompt(), "text")
    params = body.params(state.max_tokens(ids, body.sampling_params.max_tokens, default=default))
    await state.check_grammar(params)
    return state.submit(ids, params, request_id, cache_salt=salt, client=client)


def _usage(r: Collected | RequestOutput | None, speculative: bool = False) -> dict[str, Any]:
    """The native usage object; `speculative` (the request's `speculative_usage`) adds what
    speculative decoding did, where the request's steps carried drafts."""
    if r is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    usage: dict[str, Any] = {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens,
    }
    if speculative and (spec := speculative_usage([r])) is not None:
        usage["speculative"] = spec
    return usage


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await decode_request(await request.read(), GenerateRequest, state.options.limits)
    rid = f"gen-{uuid.uuid4().hex}"
    stream = await _submit(state, body, rid, request.get(TENANT), client_of(request))
    if not body.stream:
        (r,) = await collect([stream])
        result: dict[str, Any] = {
            "id": rid,
            "text": r.text,
            "token_ids": r.token_ids,
            "finish_reason": r.finish_reason,
            "usage": _usage(r, body.speculative_usage),
        }
        if body.sampling_params.logprobs is not None:
            result["logprobs"] = [_logprob(lp.token_id, lp.logprob, lp.top_logprobs) for lp in r.logprobs]
        return web.json_response(result)

    async def events() -> AsyncGenerator[dict[str, Any], None]:
        async with aclosing(merge([stream])) as outputs:
            async for _, out in outputs:
                usage = {"usage": _usage(out, body.speculative_usage)} if out.finished else {}
                yield {
                    "id": rid,
                    "text": out.text,
                    "token_ids": out.token_ids,
                    "finish_reason": out.finish_reason,
                    **usage,
                }

    return await sse_response(request, events())


def _logprob(token_id: int, logprob: float, top: tuple[tuple[int, float], ...]) -> dict[str, Any]:
    return {"token_id": token_id, "logprob": logprob, "top_logprobs": [list(t) for t in top]}


class _Socket:
    """One websocket connection: its requests run as tasks; sends are serialized."""

    def __init__(self, state: ServerState, ws: web.WebSocketResponse, tenant: Tenant | None) -> None:
        self.state = state
        self.ws = ws
        # Whose key the socket proved: its requests are that tenant's (None until it does).
        self.tenant = tenant
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.notices: set[asyncio.Task[None]] = set()  # "done" events for requests cancelled before they ran
        self.lock = asyncio.Lock()
        self.prefix = f"ws-{uuid.uuid4().hex[:12]}-"

    async def send(self, event: dict[str, Any]) -> None:
        if self.ws.closed:
            return
        async with self.lock:
            with contextlib.suppress(ConnectionError):
                await self.ws.send_json(event)

    async def error(self, message: str, rid: str | None) -> None:
        await self.send({"type": "error", "id": rid, "message": clip_message(message)})

    async def handle(self, data: str) -> None:
        try:
            await self._handle(data)
        except Exception as e:  # whatever one message does wrong, the socket and its other requests live on
            log.exception("websocket message failed")
            await self.error(f"internal error: {e}", peek_id(data))

    async def authenticate(self) -> bool:
        """Wait for the first message, which must be `auth` with the right key; anything else,
        or nothing within AUTH_TIMEOUT_S, gets an error event and closes the socket."""
        try:
            # A deadline around the whole wait: receive()'s own timeout starts again after every
            # ping or pong, which would let a client without the key hold the socket forever.
            async with asyncio.timeout(AUTH_TIMEOUT_S):
                message = await self.ws.receive()
        except TimeoutError:
            message = None
        if message is not None and message.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
            return False  # the client closed the socket, or the server is shutting down
        if message is not None and message.type == WSMsgType.TEXT and await self._carries_key(message.data):
            await self.send({"type": "auth_ok"})
            return True
        await self.error(AUTH_ERROR, None)
        await self.ws.close(code=UNAUTHORIZED, message=b"missing or wrong API key")
        return False

    async def _carries_key(self, data: str) -> bool:
        try:
            msg = await decode_ws_async(data)  # the union, so that the "type" tag must be there
        except ApiError:
            return False
        return isinstance(msg, WsAuth) and self._is_key(msg)

    def _is_key(self, msg: WsAuth) -> bool:
        """Whether the message carries a key; if so, the socket's requests from now on are that
        key's tenant's. Compared exactly as the Authorization header is (the header's token is
        stripped of its framing whitespace; a JSON string has none)."""
        tenant = self.state.tenants.match(msg.api_key.encode("utf-8", "surrogatepass"))
        if tenant is not None:
            self.tenant = tenant
        return tenant is not None

    async def _handle(self, data: str) -> None:
        try:
            msg = await decode_ws_async(data)
            check_limits(msg, self.state.options.limits)
        except ApiError as e:
            await self.error(e.message, peek_id(data))
            return
        if isinstance(msg, WsAuth):  # again, on a socket already let in: say whether this key is right
            if self._is_key(msg):
                await self.send({"type": "auth_ok"})
            else:
                await self.error("wrong API key", None)
            return
        if isinstance(msg, WsCancel):
            task = self.tasks.get(msg.id)
            if task is None:
                await self.error(f"no request with id {msg.id!r} is running", msg.id)
            else:
                task.cancel()
            return
        if msg.id in self.tasks:
            await self.error(f"id {msg.id!r} is already in use on this socket", msg.id)
            return
        try:
            client = client_key(self.state.options, self.tenant, self.ws)  # the socket, or its key's tenant
            stream = await _submit(self.state, msg, self.prefix + msg.id, self.tenant, client)
        except ApiError as e:
            await self.error(e.message, msg.id)
            return
        task = asyncio.create_task(self.run(msg.id, stream, msg.speculative_usage))
        self.tasks[msg.id] = task
        task.add_done_callback(lambda t: self._ended(msg.id, t))

    def _ended(self, rid: str, task: asyncio.Task[None]) -> None:
        if self.tasks.get(rid) is task:
            del self.tasks[rid]
        if task.cancelled():
            # Cancelled before its first step (generate and cancel in one read): `run` never ran,
            # so nothing reached the engine, and the client still needs its "done".
            done = {"type": "done", "id": rid, "finish_reason": "abort", "usage": _usage(None)}
            notice = asyncio.get_running_loop().create_task(self.send(done))
            self.notices.add(notice)
            notice.add_done_callback(self.notices.discard)

    async def run(self, rid: str, stream: Stream, speculative: bool = False) -> None:
        usage = _usage(None)
        finished = False
        try:
            async with aclosing(stream):
                async for out in stream:
                    usage = _usage(out, speculative)
                    for k, token_id in enumerate(out.token_ids):
                        text = out.text if k == len(out.token_ids) - 1 else ""
                        event: dict[str, Any] = {"type": "token", "id": rid, "token_id": token_id, "text": text}
                        if out.logprobs is not None:
                            event["logprob"] = out.logprobs[k].logprob
                        await self.send(event)
                    if out.finished:
                        finished = True
                        await self.send({"type": "done", "id": rid, "finish_reason": out.finish_reason, "usage": usage})
        except asyncio.CancelledError:
            # Cancelled by the client (or the socket closed): the stream is closed, so the engine
            # has aborted the request and freed its KV blocks.
            if not finished:
                await self.send({"type": "done", "id": rid, "finish_reason": "abort", "usage": usage})
        except Exception as e:
            await self.error(f"the request failed: {e}", rid)

    async def close(self) -> None:
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *self.notices, return_exceptions=True)


async def websocket(request: web.Request) -> web.WebSocketResponse:
    state = request.app[STATE]
    ws = web.WebSocketResponse(heartbeat=30.0)
    await ws.prepare(request)
    state.websockets.add(ws)
    # Without the header (let in by the auth middleware), the key must come first; a server
    # without keys lets everyone in as its one tenant.
    sock = _Socket(state, ws, state.tenants.match(bearer_token(request.headers.get("Authorization", ""))))
    try:
        if sock.tenant is not None or await sock.authenticate():
            async for message in ws:
                if message.type == WSMsgType.TEXT:
                    await sock.handle(message.data)
                elif message.type == WSMsgType.BINARY:
                    await sock.error("send JSON as text messages", None)
    finally:
        await sock.close()
        state.websockets.discard(ws)
    return ws
