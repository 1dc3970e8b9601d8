"""The playground's server side: the page at /, /debug/pipeline, and what the websocket gained
for it (the key as a first message, and `chat`). The page itself runs in a browser in
test_playground_browser.py."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import WSMsgType, web
from aiohttp.test_utils import TestClient, TestServer
from live_server import LiveServer

from ppserve.engine.config import EngineConfig
from ppserve.engine.model.kernel_choice import ROWS
from ppserve.engine.model.linear import KERNELS
from ppserve.engine.runtime.timeline import Interval, Timeline
from ppserve.server import native_api
from ppserve.server.responses import PipelineView, WsEvent
from ppserve.server.state import STATE, ServerOptions, ServerState

GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is a pipeline?"},
    {"role": "assistant", "content": "Stages in a row."},
    {"role": "user", "content": "And a bubble?"},
]


# ---- Timeline.recent (no server) ----------------------------------------------------------


def test_recent_is_the_newest_intervals_ending_after_since() -> None:
    timeline = Timeline(pp_size=2)
    # Results arrive in micro-batch order, each with both stages; stage 1 runs behind stage 0.
    for mb in range(100):
        for stage in (0, 1):
            start = mb + 0.5 * stage
            timeline.intervals.append(Interval(stage, mb, "decode", 1, 0, start, start + 0.4))
    everything = list(timeline.intervals)
    for since in (-1.0, 0.0, 49.9, 50.45, 99.5, 200.0):
        for limit in (1, 7, 1000):
            expected = [i for i in everything if i.end > since][-limit:]
            assert timeline.recent(since, limit) == expected, (since, limit)


# ---- the page -----------------------------------------------------------------------------


@pytest.mark.slow
def test_page_needs_no_key_and_stays_in_its_sandbox(live_server: LiveServer) -> None:
    status, headers, body = live_server.request("GET", "/", headers={"Authorization": ""})
    assert status == 200
    assert headers["Content-Type"] == "text/html; charset=utf-8"
    assert headers["X-Content-Type-Options"] == "nosniff"
    csp = dict(part.strip().split(" ", 1) for part in headers["Content-Security-Policy"].split(";"))
    assert csp["default-src"] == "'none'" and csp["connect-src"] == "'self'"
    for kind in ("script-src", "style-src"):  # the page's own inline blocks, by hash; nothing else
        assert re.fullmatch(r"'sha256-[A-Za-z0-9+/]{43}='", csp[kind]), csp[kind]
    page = body.decode()
    assert "<title>ppserve playground</title>" in page
    # Nothing from elsewhere: the only URL in it is the SVG namespace, which is a name, not a fetch.
    assert set(re.findall(r"(?:https?:)?//[\w.-]+\.\w+[^\s\"'`)]*", page)) == {"http://www.w3.org/2000/svg"}
    for needle in ('id="prompt"', 'id="send"', 'id="stop"', 'id="messages"', 'id="api-key"', '"/debug/pipeline'):
        assert needle in page


# ---- /debug/pipeline ----------------------------------------------------------------------


def _view(server: LiveServer, query: str = "") -> PipelineView:
    status, _, raw = server.request("GET", "/debug/pipeline" + query)
    assert status == 200, raw
    return msgspec.json.decode(raw, type=PipelineView)


@pytest.mark.slow
def test_pipeline_view(live_server: LiveServer) -> None:
    assert live_server.request("GET", "/debug/pipeline", headers={"Authorization": ""})[0] == 401
    # The server is shared with other tests: start once what they sent has ended.
    live_server.wait_until(lambda: (v := _view(live_server)).running == v.waiting == 0, what="the server to be idle")
    status, _, raw = live_server.request("POST", "/generate", {"text": "The pipeline", "sampling_params": GREEDY})
    assert status == 200, raw

    view = _view(live_server)
    assert view.model == live_server.model and view.pp_size == 2 and view.status == "ok" and view.error is None
    assert view.chat_template
    assert view.running == view.waiting == view.kv_blocks_used == 0 and view.kv_blocks_total > 0
    assert len(view.stage_busy) == 2 and all(0 < b <= 1 for b in view.stage_busy)
    assert {i.stage for i in view.intervals} == {0, 1} and view.intervals[-1].end <= view.time
    for stage in (0, 1):  # each stage's intervals in the order they ran
        ends = [i.end for i in view.intervals if i.stage == stage]
        assert ends == sorted(ends)
    decodes = [i for i in view.intervals if i.kind == "decode"]
    # Each stage computed every generated token but the first in decode steps: one token a step, or
    # a token and its drafts (speculative decoding), so at least one row per token.
    assert sum(i.tokens for i in decodes) >= 2 * (GREEDY["max_tokens"] - 1) and all(i.tokens >= 1 for i in decodes)
    # Each stage's CPU kernels: the tiny llama's float32 linears, each shape's kernel per timed row count.
    assert len(view.kernels) == 2 and all(k.rows == list(ROWS) for k in view.kernels)
    for k in view.kernels:
        assert k.linears and all(len(ks) == len(ROWS) and set(ks) <= set(KERNELS) for ks in k.linears.values())

    # `since`: only what ended after it (nothing ran meanwhile, so exactly the later part).
    since = view.intervals[len(view.intervals) // 2].end
    later = _view(live_server, f"?since={since!r}").intervals
    assert later and later == [i for i in view.intervals if i.end > since]
    assert _view(live_server, f"?since={view.time}").intervals == []

    for bad in ("abc", "nan", "inf", "1e999", "", "1_000", "0x10"):
        status, _, raw = live_server.request("GET", f"/debug/pipeline?since={bad}")
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == "since" and error["type"] == "invalid_request_error", bad


# ---- the websocket: the key as a first message --------------------------------------------


async def _receive(ws: aiohttp.ClientWebSocketResponse) -> dict[str, Any]:
    event: dict[str, Any] = await asyncio.wait_for(ws.receive_json(), timeout=60)
    msgspec.convert(event, WsEvent)  # as documented
    return event


async def _until_done(ws: aiohttp.ClientWebSocketResponse, rid: str) -> list[dict[str, Any]]:
    events = [await _receive(ws)]
    while not (events[-1]["id"] == rid and events[-1]["type"] in ("done", "error")):
        events.append(await _receive(ws))
    return events


async def _refused(ws: aiohttp.ClientWebSocketResponse) -> None:
    """The server's answer to a socket without the key: an error event, then close code 4401."""
    error = await _receive(ws)
    assert error["type"] == "error" and error["id"] is None and "missing or wrong API key" in error["message"]
    closing = await asyncio.wait_for(ws.receive(), timeout=60)
    assert closing.type in (WSMsgType.CLOSE, WSMsgType.CLOSED) and ws.close_code == native_api.UNAUTHORIZED


@pytest.mark.slow
async def test_websocket_key_as_first_message(live_server: LiveServer) -> None:
    url = live_server.url + "/ws"
    generate = {"type": "generate", "id": "g", "text": "The pipeline", "sampling_params": GREEDY}
    async with aiohttp.ClientSession() as session:  # no Authorization header, as in a browser
        async with session.ws_connect(url) as ws:
            await ws.send_json({"type": "auth", "api_key": live_server.api_key})
            assert await _receive(ws) == {"type": "auth_ok"}
            await ws.send_json(generate)
            events = await _until_done(ws, "g")
            assert [e["type"] for e in events] == ["token"] * 12 + ["done"]
            # Authenticated already: a second auth says whether its key is right, and the socket serves on.
            await ws.send_json({"type": "auth", "api_key": "whatever"})
            assert await _receive(ws) == {"type": "error", "id": None, "message": "wrong API key"}
            await ws.send_json({"type": "auth", "api_key": live_server.api_key})
            assert await _receive(ws) == {"type": "auth_ok"}

        for first in (
            {"type": "auth", "api_key": "wrong"},
            {"type": "auth", "api_key": f"{live_server.api_key} "},  # exactly the key, as the header
            {"type": "auth", "api_key": "\ud800"},  # not UTF-8: unequal, not a crash
            {"api_key": live_server.api_key},  # not an auth message without its type
            generate,  # anything else first
        ):
            async with session.ws_connect(url) as ws:
                await ws.send_str(json.dumps(first))
                await _refused(ws)
        async with session.ws_connect(url) as ws:
            await ws.send_bytes(b"\x00")
            await _refused(ws)

        # The header still works, with no auth message; a wrong one is refused before the upgrade.
        async with session.ws_connect(url, headers=live_server.headers) as ws:
            await ws.send_json(generate)
            assert (await _until_done(ws, "g"))[-1]["type"] == "done"
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await session.ws_connect(url, headers={"Authorization": "Bearer wrong"})
        assert refused.value.status == 401
    errors = [line for line in live_server.output if " ERROR " in line or line.startswith("Traceback")]
    assert not errors, "".join(errors)


# In-process, without an engine (authentication needs none): the time limit, made short.


@pytest.fixture
async def socket_only(llama_dir: Path) -> AsyncIterator[Callable[[str | None], Any]]:
    """Starts an app with just /ws for a given API key; yields a function that makes it."""
    clients: list[TestClient[web.Request, web.Application]] = []

    async def start(api_key: str | None) -> TestClient[web.Request, web.Application]:
        app = web.Application()
        app[STATE] = ServerState(EngineConfig.create(llama_dir), ServerOptions(api_key=api_key))
        native_api.add_routes(app)
        client = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()


async def test_websocket_without_the_key_is_closed_in_time(
    socket_only: Callable[[str | None], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native_api, "AUTH_TIMEOUT_S", 0.2)
    client = await socket_only("secret")
    async with client.ws_connect("/ws") as ws:
        await _refused(ws)  # it sent nothing
    # Pings and pongs are not messages: they do not stretch the time limit.
    async with client.ws_connect("/ws", autoclose=False) as ws:
        pinger = asyncio.create_task(_ping_every(ws, 0.05))
        try:
            await _refused(ws)
        finally:
            pinger.cancel()


async def _ping_every(ws: aiohttp.ClientWebSocketResponse, period_s: float) -> None:
    while not ws.closed:
        await ws.ping()
        await ws.pong()
        await asyncio.sleep(period_s)  # the pace of a keep-alive, not a wait for a condition


async def test_websocket_auth_without_a_key_is_ok(socket_only: Callable[[str | None], Any]) -> None:
    client = await socket_only(None)
    async with client.ws_connect("/ws") as ws:
        await ws.send_json({"type": "auth", "api_key": "anything"})
        assert await _receive(ws) == {"type": "auth_ok"}
        await ws.send_json({"type": "cancel", "id": "nobody"})  # the socket serves on
        assert (await _receive(ws))["id"] == "nobody"


# ---- the websocket: chat ------------------------------------------------------------------


@pytest.mark.slow
async def test_websocket_chat_streams_what_chat_completions_answers(live_server: LiveServer) -> None:
    body = {"messages": CONVERSATION, **GREEDY}
    status, _, raw = await asyncio.to_thread(live_server.request, "POST", "/v1/chat/completions", body)
    assert status == 200, raw
    answer = json.loads(raw)
    async with (
        aiohttp.ClientSession(headers=live_server.headers) as session,
        session.ws_connect(live_server.url + "/ws") as ws,
    ):
        await ws.send_json({"type": "chat", "id": "c", "messages": CONVERSATION, "sampling_params": GREEDY})
        events = await _until_done(ws, "c")
        tokens, done = events[:-1], events[-1]
        usage = done["usage"]
        assert done["type"] == "done" and (usage["prompt_tokens"], usage["completion_tokens"]) == (
            answer["usage"]["prompt_tokens"],
            answer["usage"]["completion_tokens"],
        )
        assert usage["cached_tokens"] > 0  # the conversation again: its prompt is in the prefix cache
        assert "".join(e["text"] for e in tokens) == answer["choices"][0]["message"]["content"]
        assert len(tokens) == 12

        # Bad conversations are error events naming the problem; the socket stays open.
        bad = [
            ([], "messages must not be empty"),
            ([{"role": "wizard", "content": "x"}], "messages"),
            ([{"role": "user", "content": [{"type": "image_url"}]}], "only text content parts"),
            ([{"role": "user", "content": "x" * 100_000}], "messages"),  # longer than the context
        ]
        for i, (messages, needle) in enumerate(bad):
            await ws.send_json({"type": "chat", "id": f"bad{i}", "messages": messages})
            error = await _receive(ws)
            assert error["type"] == "error" and error["id"] == f"bad{i}" and needle in error["message"], error
        await ws.send_json({"type": "chat", "id": "d", "messages": CONVERSATION[-1:], "sampling_params": GREEDY})
        assert (await _until_done(ws, "d"))[-1]["type"] == "done"
