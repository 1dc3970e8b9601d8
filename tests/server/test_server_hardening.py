"""A live server against hostile or careless clients: out-of-range numbers, huge prompts, odd
headers, browser-borne requests, disconnects and garbage on the port. (The pieces that need no
server, in-process: test_server_hardening_unit.py.)"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from live_server import LiveServer

from ppserve.engine.model.tokenizer import Tokenizer

COMP, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
USER = [{"role": "user", "content": "hi"}]
BIG = 2**64  # fits JSON, not the engine's int32 / int64 wire fields


# ---- a live server ----------------------------------------------------------------------------


def _error(server: LiveServer, path: str, body: Any, status: int = 400, **headers: str) -> dict[str, Any]:
    code, _, raw = server.request("POST", path, body, headers=headers)
    assert code == status, raw
    error: dict[str, Any] = json.loads(raw)["error"]
    assert error["code"] == status
    return error


def _raw(server: LiveServer, data: bytes) -> bytes:
    """Send bytes exactly as given; return everything the server answers before closing."""
    url = urlsplit(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        sock.sendall(data)
        return b"".join(iter(lambda: sock.recv(65536), b""))


OUT_OF_RANGE: list[tuple[str, dict[str, Any], str]] = [
    (COMP, {"prompt": "a", "max_tokens": 2, "top_k": BIG}, "top_k"),  # once a dead engine
    (COMP, {"prompt": "a", "top_k": 2**31}, "top_k"),
    (COMP, {"prompt": "a", "seed": 2**63}, "seed"),
    (COMP, {"prompt": "a", "max_tokens": 2**31}, "max_tokens"),
    (COMP, {"prompt": "a", "logprobs": BIG}, "logprobs"),
    (COMP, {"prompt": "a", "stop_token_ids": [2**31]}, "stop_token_ids[0]"),
    (COMP, {"prompt": [5, 2**31]}, "prompt"),
    (COMP, {"prompt": [[5], [BIG]]}, "prompt"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"messages": USER, "max_tokens": BIG}, "max_tokens"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": BIG}, "top_logprobs"),
    (GEN, {"text": "a", "sampling_params": {"seed": BIG}}, "sampling_params.seed"),
    (GEN, {"text": "a", "sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens"),
    (GEN, {"input_ids": [2**31]}, "input_ids"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("path", "body", "field"), OUT_OF_RANGE)
def test_integers_out_of_range_are_400_naming_the_field(
    live_server: LiveServer, path: str, body: dict[str, Any], field: str
) -> None:
    assert _error(live_server, path, body)["param"] == field
    code, _, raw = live_server.request("POST", COMP, {"prompt": "still alive", "max_tokens": 2})
    assert code == 200, raw


@pytest.mark.slow
def test_largest_seed_with_n_wraps_after_choice_0(live_server: LiveServer) -> None:
    def texts(seed: int, n: int) -> list[str]:
        body = {"prompt": "Seeds", "max_tokens": 6, "temperature": 1.0, "seed": seed, "n": n, "ignore_eos": True}
        code, _, raw = live_server.request("POST", COMP, body)
        assert code == 200, raw
        return [c["text"] for c in sorted(json.loads(raw)["choices"], key=lambda c: c["index"])]

    top = 2**63 - 1
    assert texts(top, 2) == [texts(top, 1)[0], texts(0, 1)[0]]  # choice 1 gets (seed + 1) mod 2**63


@pytest.mark.slow
def test_auth_header_edge_cases(live_server: LiveServer) -> None:
    ok = {"prompt": "a", "max_tokens": 1}
    for scheme in ("bearer", "BEARER"):  # RFC 7235: the scheme is case-insensitive
        code, _, raw = live_server.request(
            "POST", COMP, ok, headers={"Authorization": f"{scheme} {live_server.api_key}"}
        )
        assert code == 200, raw
    url = urlsplit(live_server.url)
    answer = _raw(
        live_server,
        b"GET /v1/models HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer \xff\xfe%s\r\nConnection: close\r\n\r\n"
        % (url.netloc.encode(), live_server.api_key.encode() if live_server.api_key else b""),
    )
    assert answer.startswith(b"HTTP/1.1 401 ") and b'"authentication_error"' in answer, answer


@pytest.mark.slow
def test_browser_requests_are_refused(live_server: LiveServer) -> None:
    """Content type, Host and Origin checks, which all come before the API key is even read."""
    ok = {"prompt": "a", "max_tokens": 1}
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        assert "application/json" in _error(live_server, COMP, ok, 415, **{"Content-Type": content_type})["message"]
    assert live_server.request("POST", COMP, ok, headers={"Content-Type": "application/json; charset=utf-8"})[0] == 200
    assert live_server.request("POST", "/nowhere", b"x", headers={"Content-Type": "text/plain"})[0] == 404

    port = urlsplit(live_server.url).port
    for host in (f"localhost:{port}", f"[::1]:{port}", "127.0.0.1"):
        assert live_server.request("GET", "/v1/models", headers={"Host": host})[0] == 200, host
    code, _, raw = live_server.request("GET", "/v1/models", headers={"Host": f"rebound.example:{port}"})
    assert code == 403 and json.loads(raw)["error"]["type"] == "permission_error"

    async def connect(origin: str | None) -> int:
        async with aiohttp.ClientSession(headers=live_server.headers) as session:
            try:
                async with session.ws_connect(live_server.url + "/ws", origin=origin) as ws:
                    await ws.close()
                    return 101
            except aiohttp.WSServerHandshakeError as e:
                return e.status

    assert asyncio.run(connect(None)) == 101  # not a browser
    assert asyncio.run(connect(live_server.url)) == 101  # the server's own page
    assert asyncio.run(connect("http://evil.example")) == 403


@pytest.fixture(scope="module")
def keyed_server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The API key from a file, one allowed origin, and a waiting queue of 2."""
    key_file = tmp_path_factory.mktemp("key") / "key"
    key_file.write_text("  from-a-file  \n\nsecond-key\n")  # one key per non-empty line
    flags = ["--api-key-file", str(key_file), "--allowed-origins", "https://app.example", "--max-waiting-requests", "2"]
    server = LiveServer(llama_dir, *flags, "--kv-cache-gb", "0.02", api_key=None)
    server.api_key = "from-a-file"  # what requests send from now on
    yield server
    assert server.stop() == 0, "".join(server.output)


@pytest.mark.slow
def test_key_file_origins_and_queue_limit(keyed_server: LiveServer) -> None:
    server = keyed_server
    assert server.request("GET", "/v1/models")[0] == 200
    assert server.request("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
    assert "from-a-file" not in Path(f"/proc/{server.proc.pid}/cmdline").read_text()

    async def connect(origin: str) -> int:
        async with aiohttp.ClientSession(headers=server.headers) as session:
            try:
                async with session.ws_connect(server.url + "/ws", origin=origin):
                    return 101
            except aiohttp.WSServerHandshakeError as e:
                return e.status

    assert asyncio.run(connect("https://app.example")) == 101
    assert asyncio.run(connect("https://other.example")) == 403

    # More streams than the queue can ever hold: a 400 naming the field, not a 503 to retry forever.
    assert _error(server, COMP, {"prompt": "a", "n": 3})["param"] == "n"
    assert _error(server, COMP, {"prompt": ["a", "b", "c"]})["param"] == "prompt"
    assert _error(server, CHAT, {"messages": USER, "n": 3})["param"] == "n"
    code, _, raw = server.request("POST", COMP, {"prompt": ["a", "b"], "max_tokens": 1})
    assert code == 200 and len(json.loads(raw)["choices"]) == 2


async def _events(ws: aiohttp.ClientWebSocketResponse, count: int) -> list[dict[str, Any]]:
    return [await asyncio.wait_for(ws.receive_json(), timeout=60) for _ in range(count)]


@pytest.mark.slow
async def test_websocket_ids_and_numbers_are_bounded(live_server: LiveServer) -> None:
    async with (
        aiohttp.ClientSession(headers=live_server.headers) as session,
        session.ws_connect(live_server.url + "/ws") as ws,
    ):
        for rid in ("x" * 257, ""):
            await ws.send_json({"type": "generate", "id": rid, "text": "a"})
        await ws.send_json({"type": "cancel", "id": "y" * 10_000})
        await ws.send_json({"type": "generate", "id": "k", "text": "a", "sampling_params": {"top_k": BIG}})
        errors = await _events(ws, 4)
        assert [e["type"] for e in errors] == ["error"] * 4
        assert [e["id"] for e in errors] == [None, None, None, "k"]  # an overlong id is not echoed
        assert all("invalid id" in e["message"] for e in errors[:3]) and "top_k" in errors[3]["message"]
        longest = "z" * 256
        await ws.send_json({"type": "generate", "id": longest, "text": "a", "sampling_params": {"max_tokens": 1}})
        token, done = await _events(ws, 2)
        assert token["id"] == done["id"] == longest and done["type"] == "done"


@pytest.mark.slow
async def test_huge_prompts_are_refused_while_streams_flow(live_server: LiveServer, llama_dir: Path) -> None:
    """Prompts that cannot fit are refused from their length, untokenized, while a stream runs on."""
    _, _, raw = live_server.request("GET", "/v1/models")
    bound = json.loads(raw)["data"][0]["max_model_len"] * Tokenizer(llama_dir).max_token_chars
    over = "x" * (bound + 1)
    huge: list[tuple[str, dict[str, Any], str]] = [
        (COMP, {"prompt": "x" * (15 * 2**20)}, "prompt"),
        (COMP, {"prompt": over}, "prompt"),
        (CHAT, {"messages": [{"role": "user", "content": over}]}, "messages"),
        (GEN, {"text": over}, "text"),
    ]
    order: list[str] = []  # what the client saw, in the order it saw it
    async with aiohttp.ClientSession(headers=live_server.headers) as session:
        body = {"prompt": "Keep going", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        stream = await session.post(live_server.url + COMP, json=body)
        assert stream.status == 200
        new_token = asyncio.Condition()

        async def read_stream() -> None:
            async for line in stream.content:
                if line.startswith(b"data: {"):
                    order.append("token")
                    async with new_token:
                        new_token.notify_all()

        async def tokens_at_least(n: int) -> None:
            async with new_token:
                await asyncio.wait_for(new_token.wait_for(lambda: order.count("token") >= n), 60)

        reader = asyncio.create_task(read_stream())
        await tokens_at_least(1)

        async def refuse(path: str, body: dict[str, Any], field: str) -> None:
            order.append(f"sent {field}")
            async with session.post(live_server.url + path, json=body) as resp:
                error = (await resp.json())["error"]
            order.append(f"refused {field}")
            assert resp.status == 400 and error["param"] == field, error
            assert "characters" in error["message"], error  # refused from its length, not tokenized

        await asyncio.gather(*(refuse(*h) for h in huge))
        # More tokens after the refusals: the stream is alive and was never cut off.
        await tokens_at_least(order.count("token") + 3)
        reader.cancel()
        stream.close()
    first_sent = order.index("sent prompt")
    last_refused = max(i for i, e in enumerate(order) if e.startswith("refused"))
    assert "token" in order[first_sent:last_refused], order  # tokens arrived while they were in flight


def _disconnect(server: LiveServer, body: dict[str, Any], read_bytes: int | None) -> None:
    """Send a request, read some of the answer (None: wait until it runs), then drop the
    connection hard (RST)."""
    url = urlsplit(server.url)
    data = json.dumps(body).encode()
    head = (
        f"POST {COMP} HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {server.api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        sock.sendall(head.encode() + data)
        got = 0
        while read_bytes is not None and got < read_bytes:
            got += len(sock.recv(read_bytes - got))
        if read_bytes is None:
            server.wait_until(lambda: server.metrics()["ppserve_kv_blocks_used"] > 0, what="the request to run")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _freed(server: LiveServer) -> bool:
    m = server.metrics()
    return m["ppserve_kv_blocks_used"] == 0 and m["ppserve_requests_running"] == 0


@pytest.mark.slow
def test_client_misbehaviour_logs_no_errors(live_server: LiveServer) -> None:
    """Garbage on the port always logged a traceback; a dropped stream only when the server's
    write raced the disconnect (test_server_hardening_unit.py pins that case down)."""
    mark = len(live_server.output)
    for garbage in (
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",
        b"GET / HTTP/9.9 x\r\n\r\n",
        b"GET / HTTP/1.1\r\nBad\r\n\r\n",
    ):
        assert _raw(live_server, garbage).startswith(b"HTTP/1.0 400 "), garbage

    long = {"prompt": "A long answer", "max_tokens": 1500, "ignore_eos": True}
    for i in range(12):  # mid-stream, at different points: the race with the server's writes varies
        _disconnect(live_server, {**long, "stream": True, "n": 1 + i % 2}, read_bytes=1 + 150 * i)
    live_server.wait_until(lambda: _freed(live_server), 60.0, "the streams' KV blocks to be freed")
    for n in (1, 2):  # while waiting for a whole answer
        _disconnect(live_server, {**long, "n": n}, read_bytes=None)
        live_server.wait_until(lambda: _freed(live_server), 60.0, "the KV blocks to be freed")

    # Everything the server logged before this request's access line is in `output` by then.
    sentinel = f"/version?sentinel={uuid.uuid4().hex}"  # (a healthy /health is not logged)
    assert live_server.request("GET", sentinel)[0] == 200
    live_server.wait_until(lambda: any(sentinel in line for line in live_server.output[mark:]), what="the log")
    log = "".join(live_server.output[mark:])
    assert "Traceback" not in log and " ERROR " not in log, log
