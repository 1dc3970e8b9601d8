"""The HTTP and websocket API of a live server: bad input, the native API, websocket streams,
client disconnects and metrics."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from live_server import LiveServer

from ppserve.server.errors import MAX_MESSAGE_CHARS

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]

# (path, body, status, text the error must contain: the field at fault)
BAD_INPUTS: list[tuple[str, Any, int, str]] = [
    (COMP, b"{bad json", 400, "JSON"),
    (COMP, [], 400, "object"),
    (COMP, {}, 400, "prompt"),
    (COMP, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    (COMP, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (COMP, {"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    (COMP, {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    (COMP, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    (COMP, {"prompt": "x", "top_k": -1}, 400, "top_k"),
    (COMP, {"prompt": "x", "min_p": 2}, 400, "min_p"),
    (COMP, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    (COMP, {"prompt": "x", "frequency_penalty": "high"}, 400, "frequency_penalty"),
    (COMP, {"prompt": "x", "seed": -1}, 400, "seed"),
    (COMP, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (COMP, {"prompt": "x", "n": 0}, 400, "n must"),
    (COMP, {"prompt": "x", "stop": [""]}, 400, "stop"),
    (COMP, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (COMP, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (COMP, {"prompt": "x", "model": "gpt-4"}, 400, "model"),
    (COMP, {"prompt": ""}, 400, "prompt"),
    (COMP, {"prompt": [1, "a"]}, 400, "prompt"),
    (COMP, {"prompt": [99999]}, 400, "prompt"),
    (COMP, {"prompt": [10] * 3000}, 400, "prompt"),  # longer than the context (2048)
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    (CHAT, {"messages": USER, "max_completion_tokens": 10**6}, 400, "max_completion_tokens"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    (CHAT, {"messages": USER, "logit_bias": {"²": 1}}, 400, "logit_bias"),  # a digit to isdigit(), not to int()
    (CHAT, {"messages": USER, "logit_bias": {"7" * 5000: 1}}, 400, "logit_bias"),  # past int()'s 4,300 digits
    (CHAT, {"messages": USER, "tools": []}, 400, "tools"),
    (CHAT, {"messages": USER, "tool_choice": "required"}, 400, "tool_choice"),
    (CHAT, {"messages": USER, "response_format": {"type": "xml"}}, 400, "response_format"),
    (COMP, {"prompt": "x", "structured_outputs": {"choice": []}}, 400, "structured_outputs"),
    ("/generate", {"text": "x", "input_ids": [1]}, 400, "text"),
    ("/generate", {"sampling_params": {"max_tokens": 4}}, 400, "text"),
    ("/generate", {"text": "x", "sampling_params": {"bogus": 1}}, 400, "bogus"),
    ("/generate", {"text": "x", "sampling_params": {"min_p": 2}}, 400, "min_p"),
    ("/generate", {"input_ids": [-1]}, 400, "prompt"),
    (COMP, {"prompt": "x", "speculative_usage": "yes"}, 400, "speculative_usage"),
    (CHAT, {"messages": USER, "speculative_usage": 1}, 400, "speculative_usage"),
    ("/generate", {"text": "x", "speculative_usage": "true"}, 400, "speculative_usage"),
    ("/nowhere", {}, 404, "Not Found"),
]


@pytest.mark.parametrize(("path", "body", "status", "needle"), BAD_INPUTS)
def test_bad_input(live_server: LiveServer, path: str, body: Any, status: int, needle: str) -> None:
    code, headers, raw = live_server.request("POST", path, body)
    assert code == status, raw
    assert headers["Content-Type"].startswith("application/json")
    error = json.loads(raw)["error"]
    assert needle in error["message"] or needle == error["param"], error
    assert error["code"] == status and error["type"]


def test_error_messages_quote_a_bounded_part_of_the_input(live_server: LiveServer) -> None:
    """An error that quotes a request's input sends back its head and tail, not all of it."""
    code, _, raw = live_server.request("GET", "/debug/pipeline?since=" + "9" * 6000 + "x")
    message = json.loads(raw)["error"]["message"]
    assert code == 400 and message.startswith("since must be") and message.endswith("9x'")
    assert len(message) <= MAX_MESSAGE_CHARS + 60 and "characters left out" in message, message


def test_server_still_serves_after_bad_input(live_server: LiveServer) -> None:
    for path, body, _, _ in BAD_INPUTS:
        live_server.request("POST", path, body)
    assert live_server.request("GET", "/health")[0] == 200
    # ignore_eos: the default sampling may draw the end-of-text token before the fourth
    body = {"prompt": "still here", "max_tokens": 4, "ignore_eos": True}
    code, _, raw = live_server.request("POST", COMP, body)
    assert code == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4


def test_auth_size_and_method(live_server: LiveServer) -> None:
    for headers in ({"Authorization": "Bearer wrong"}, {"Authorization": ""}):
        code, _, raw = live_server.request("POST", COMP, {"prompt": "x"}, headers=headers)
        assert code == 401 and "API key" in json.loads(raw)["error"]["message"]
    assert live_server.request("GET", "/health", headers={"Authorization": ""})[0] == 200  # open to probes
    assert live_server.request("GET", "/metrics", headers={"Authorization": ""})[0] == 401  # see --metrics-public
    code, _, raw = live_server.request("POST", COMP, b'{"prompt": "' + b"a" * (17 * 2**20) + b'"}')
    assert code == 413 and json.loads(raw)["error"]["code"] == 413
    code, _, raw = live_server.request("GET", COMP)
    assert code == 405 and json.loads(raw)["error"]["code"] == 405


def test_native_generate(live_server: LiveServer) -> None:
    body = {"text": "The pipeline", "sampling_params": {"max_tokens": 6, "temperature": 0, "logprobs": 2}}
    code, _, raw = live_server.request("POST", "/generate", body)
    assert code == 200, raw
    whole = json.loads(raw)
    assert len(whole["token_ids"]) == 6 and whole["usage"]["completion_tokens"] == 6
    assert [lp["token_id"] for lp in whole["logprobs"]] == whole["token_ids"]

    code, headers, raw = live_server.request("POST", "/generate", {**body, "stream": True})
    assert code == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    parts = [json.loads(e) for e in events[:-1]]
    assert [t for p in parts for t in p["token_ids"]] == whole["token_ids"]
    assert "".join(p["text"] for p in parts) == whole["text"]
    assert parts[-1]["finish_reason"] == "length" and parts[-1]["usage"]["completion_tokens"] == 6


async def _events(ws: aiohttp.ClientWebSocketResponse, until: Any) -> list[dict[str, Any]]:
    """Websocket events until `until(events)` is true (bounded, so a bug fails instead of hanging)."""
    events: list[dict[str, Any]] = []
    while not until(events):
        events.append(await asyncio.wait_for(ws.receive_json(), timeout=60))
    return events


def _done(*ids: str) -> Any:
    return lambda events: {e["id"] for e in events if e["type"] == "done"} >= set(ids)


async def test_websocket(live_server: LiveServer) -> None:
    async with (
        aiohttp.ClientSession(headers=live_server.headers) as session,
        session.ws_connect(live_server.url + "/ws") as ws,
    ):
        # Two interleaved streams on one socket.
        greedy = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
        await ws.send_json({"type": "generate", "id": "a", "text": "The pipeline", "sampling_params": greedy})
        await ws.send_json(
            {"type": "generate", "id": "b", "text": "A river", "sampling_params": {**greedy, "max_tokens": 6}}
        )
        events = await _events(ws, _done("a", "b"))
        tokens = {rid: [e["token_id"] for e in events if e["type"] == "token" and e["id"] == rid] for rid in "ab"}
        assert len(tokens["a"]) == 12 and len(tokens["b"]) == 6
        order = [e["id"] for e in events if e["type"] == "token"]
        assert order.index("b") < len(order) - 1 - order[::-1].index("a"), "the streams did not interleave"
        done = {e["id"]: e for e in events if e["type"] == "done"}
        assert done["a"]["finish_reason"] == "length" and done["a"]["usage"]["completion_tokens"] == 12
        _, _, raw = live_server.request("POST", "/generate", {"text": "The pipeline", "sampling_params": greedy})
        assert tokens["a"] == json.loads(raw)["token_ids"]  # same as the native API

        # Cancel a long request after its first token.
        long = {"max_tokens": 1000, "ignore_eos": True}
        await ws.send_json({"type": "generate", "id": "c", "text": "Keep going", "sampling_params": long})
        await _events(ws, lambda ev: any(e["type"] == "token" for e in ev))
        await ws.send_json({"type": "cancel", "id": "c"})
        events = await _events(ws, _done("c"))
        assert events[-1]["finish_reason"] == "abort" and events[-1]["usage"]["completion_tokens"] < 1000

        # Malformed messages get an error event; the socket stays usable.
        await ws.send_str("not json")
        await ws.send_json({"type": "generate", "id": "d"})
        await ws.send_json({"type": "dance", "id": "e"})
        await ws.send_json({"type": "cancel", "id": "nobody"})
        errors = await _events(ws, lambda ev: len(ev) == 4)
        assert [e["type"] for e in errors] == ["error"] * 4
        assert [e["id"] for e in errors] == [None, "d", "e", "nobody"]
        assert "text" in errors[1]["message"]
        await ws.send_json({"type": "generate", "id": "f", "input_ids": [5, 6, 7], "sampling_params": greedy})
        events = await _events(ws, _done("f"))
        # No `speculative` object, drafts or not: the message did not ask for it (speculative_usage).
        assert events[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "cached_tokens": 0}


# A prompt that repeats itself, decoded greedily: the n-gram drafter drafts from it (and from the
# output, which the tiny model soon repeats too). Whether a step carries drafts is still the
# scheduler's choice, from its step timings, so a test tries a few times for a request that drafted.
SPEC_PROMPT = [5, 6, 7, 8] * 8
SPEC_CHAT = [{"role": "user", "content": "la " * 24}]
SPEC_GREEDY = {"max_tokens": 32, "temperature": 0, "ignore_eos": True}
SPEC_TRIES = 8


def _final_usage(server: LiveServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The usage of an answer, or of a stream's last event that has one."""
    code, _, raw = server.request("POST", path, body)
    assert code == 200, raw
    if not body.get("stream"):
        return dict(json.loads(raw)["usage"])
    events = [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: {")]
    return dict([e for e in events if e.get("usage")][-1]["usage"])


def _drafted_usage(server: LiveServer, path: str, body: dict[str, Any], key: str) -> dict[str, Any]:
    """The usage of the first try whose steps carried drafts (it has `key`); each try's usage
    has `speculative` only if the request asked for it."""
    for _ in range(SPEC_TRIES):
        usage = _final_usage(server, path, body)
        assert ("speculative" in usage) <= bool(body.get("speculative_usage")), (path, usage)
        if key in usage:
            return usage
    raise AssertionError(f"no try of {path} carried drafts: {usage}")


@pytest.mark.parametrize("stream", [False, True])
def test_speculative_usage_only_when_asked(live_server: LiveServer, stream: bool) -> None:
    """usage.speculative (ppserve's) comes with `speculative_usage: true` only; OpenAI's
    prediction-token counts come whenever the steps carried drafts, asked or not."""
    streaming: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    for path, body in [
        (COMP, {"prompt": SPEC_PROMPT, **SPEC_GREEDY, **streaming}),
        (CHAT, {"messages": SPEC_CHAT, **SPEC_GREEDY, **streaming}),
    ]:
        plain = _drafted_usage(live_server, path, body, "completion_tokens_details")
        assert "speculative" not in plain, (path, plain)
        asked = _drafted_usage(live_server, path, {**body, "speculative_usage": True}, "completion_tokens_details")
        spec, details = asked["speculative"], asked["completion_tokens_details"]
        assert spec["accepted_tokens"] == details["accepted_prediction_tokens"], (path, asked)
        assert spec["draft_tokens"] == spec["accepted_tokens"] + details["rejected_prediction_tokens"]
    native = {"input_ids": SPEC_PROMPT, "sampling_params": SPEC_GREEDY, "stream": stream}
    assert "speculative" not in _final_usage(live_server, "/generate", native)
    asked = _drafted_usage(live_server, "/generate", {**native, "speculative_usage": True}, "speculative")
    assert asked["speculative"]["draft_tokens"] > 0, asked


async def test_websocket_speculative_usage_only_when_asked(live_server: LiveServer) -> None:
    """The websocket's `generate` and `chat` follow /generate: `speculative` only when asked."""
    messages: list[dict[str, Any]] = [
        {"type": "generate", "input_ids": SPEC_PROMPT, "sampling_params": SPEC_GREEDY},
        {"type": "chat", "messages": SPEC_CHAT, "sampling_params": SPEC_GREEDY},
    ]
    async with (
        aiohttp.ClientSession(headers=live_server.headers) as session,
        session.ws_connect(live_server.url + "/ws") as ws,
    ):
        for msg in messages:
            for k in range(SPEC_TRIES):
                plain, asked = f"{msg['type']}-{k}", f"{msg['type']}-{k}-asked"
                await ws.send_json({**msg, "id": plain})
                await ws.send_json({**msg, "id": asked, "speculative_usage": True})
                done = {e["id"]: e["usage"] for e in await _events(ws, _done(plain, asked)) if e["type"] == "done"}
                assert "speculative" not in done[plain], done
                if "speculative" in done[asked]:
                    assert done[asked]["speculative"]["draft_tokens"] > 0, done
                    break
            else:
                raise AssertionError(f"no websocket {msg['type']} carried drafts")


def _freed(server: LiveServer) -> bool:
    m = server.metrics()
    return m["ppserve_kv_blocks_used"] == 0 and m["ppserve_requests_running"] == 0


async def _wait_freed(server: LiveServer) -> None:
    await asyncio.to_thread(server.wait_until, lambda: _freed(server), 30.0, "the request's KV blocks to be freed")


async def test_disconnect_mid_stream_frees_kv_blocks(live_server: LiveServer) -> None:
    body = {"prompt": "A long answer", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(headers=live_server.headers) as session:
        resp = await session.post(live_server.url + COMP, json=body)
        assert resp.status == 200
        for _ in range(3):
            assert (await resp.content.readline()).startswith(b"data: ")
            await resp.content.readline()
        assert live_server.metrics()["ppserve_kv_blocks_used"] > 0
        resp.close()  # drop the connection mid-stream
    await _wait_freed(live_server)


async def test_disconnect_while_waiting_for_a_whole_answer_frees_kv_blocks(live_server: LiveServer) -> None:
    body = {"prompt": "A long answer", "max_tokens": 1500, "ignore_eos": True}
    async with aiohttp.ClientSession(headers=live_server.headers) as session:
        post = asyncio.create_task(session.post(live_server.url + COMP, json=body))
        await asyncio.to_thread(
            live_server.wait_until, lambda: live_server.metrics()["ppserve_kv_blocks_used"] > 0, 30.0, "the request"
        )
        post.cancel()  # the client gives up before the answer: its connection closes
        with pytest.raises(asyncio.CancelledError):
            await post
    await _wait_freed(live_server)


async def test_websocket_closed_with_requests_in_flight_frees_kv_blocks(live_server: LiveServer) -> None:
    long = {"max_tokens": 1500, "ignore_eos": True}
    async with aiohttp.ClientSession(headers=live_server.headers) as session:
        ws = await session.ws_connect(live_server.url + "/ws")
        for rid in ("x", "y"):
            await ws.send_json({"type": "generate", "id": rid, "text": "Keep going", "sampling_params": long})
        await _events(ws, lambda ev: {e["id"] for e in ev if e["type"] == "token"} == {"x", "y"})
        # Generate and cancel back to back: the cancel may arrive before the request ever ran.
        await ws.send_str(json.dumps({"type": "generate", "id": "z", "text": "Never mind", "sampling_params": long}))
        await ws.send_str(json.dumps({"type": "cancel", "id": "z"}))
        events = await _events(ws, _done("z"))
        assert [e["finish_reason"] for e in events if e["type"] == "done"] == ["abort"]
        await ws.close()
    await _wait_freed(live_server)


def test_metrics(live_server: LiveServer) -> None:
    live_server.request("POST", COMP, {"prompt": "count me", "max_tokens": 5})
    m = live_server.metrics()
    assert m["ppserve_generation_tokens_total"] >= 5 and m["ppserve_prompt_tokens_total"] > 0
    assert m["ppserve_time_to_first_token_seconds_count"] >= 1
    assert m["ppserve_inter_token_latency_seconds_count"] >= 4
    assert m["ppserve_e2e_request_latency_seconds_count"] >= 1
    assert m['ppserve_requests_total{finish_reason="length"}'] >= 1
    assert m["ppserve_kv_blocks_total"] > 0 and m["ppserve_requests_waiting"] == 0
    busy = [m[f'ppserve_stage_busy_fraction{{stage="{i}"}}'] for i in range(2)]
    assert all(0 <= b <= 1 for b in busy) and any(b > 0 for b in busy)
