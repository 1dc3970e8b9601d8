"""The router against stand-in servers (in-process, no model): what it tells a decode server,
and how a stream that stalls ends."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from ppserve.server.router import ROUTER, create_router
from ppserve.transport.cluster_key import route_proof

KEY = b"the-router-and-servers-secret"
BOOTSTRAP = "tcp://127.0.0.1:9100"
READ_TIMEOUT_S = 2.0  # between two reads of the decode server (here: after its first event)


def _backend(side: str, seen: list[dict[str, str]], stall: asyncio.Event) -> TestServer:
    """A stand-in server of one side: its /health; completions stream one event, then nothing
    until `stall` is set."""

    async def health(request: web.Request) -> web.Response:
        pd = {"mode": side, **({"bootstrap": BOOTSTRAP} if side == "prefill" else {})}
        return web.json_response({"status": "ok", "disaggregation": pd})

    async def completions(request: web.Request) -> web.StreamResponse:
        seen.append(dict(request.headers))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        await stall.wait()
        return out

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    return TestServer(app)


@pytest.fixture
async def deployment() -> AsyncIterator[tuple[TestClient[Any, Any], list[dict[str, str]], asyncio.Event]]:
    seen: list[dict[str, str]] = []
    stall = asyncio.Event()
    prefill, decode = _backend("prefill", seen, stall), _backend("decode", seen, stall)
    await prefill.start_server()
    await decode.start_server()
    urls = [str(s.make_url("")).rstrip("/") for s in (prefill, decode)]
    app = create_router([urls[0]], [urls[1]], KEY, read_timeout_s=READ_TIMEOUT_S)
    async with TestClient(TestServer(app)) as client:
        deadline = asyncio.get_running_loop().time() + 30
        while not all(b.healthy for b in app[ROUTER].backends):  # its first /health checks
            assert asyncio.get_running_loop().time() < deadline, [b.why for b in app[ROUTER].backends]
            await asyncio.sleep(0.05)
        yield client, seen, stall
        stall.set()
    await prefill.close()
    await decode.close()


async def test_the_router_proves_the_prefill_server_it_names(
    deployment: tuple[TestClient[Any, Any], list[dict[str, str]], asyncio.Event],
) -> None:
    client, seen, stall = deployment
    stall.set()
    resp = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert resp.status == 200
    await resp.read()
    assert seen[0]["X-PPServe-Prefill"] == BOOTSTRAP
    assert seen[0]["X-PPServe-Prefill-Proof"] == route_proof(KEY, BOOTSTRAP)


async def test_a_stream_that_stalls_ends_with_an_error_event_and_done(
    deployment: tuple[TestClient[Any, Any], list[dict[str, str]], asyncio.Event],
) -> None:
    """Streams have no total timeout (aiohttp's default 300 s cut long streams with no error and
    no [DONE]); only a read timeout between chunks, after which the stream ends cleanly."""
    client, _, _ = deployment
    assert client.app is not None
    router = client.app[ROUTER]
    assert router.session is not None and router.session.timeout.total is None
    resp = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    lines = [line for line in (await resp.text()).splitlines() if line.startswith("data: ")]
    assert json.loads(lines[0][6:])["choices"][0]["text"] == "a"
    error = json.loads(lines[1][6:])["error"]
    assert error["code"] == 503 and f"sent nothing for {READ_TIMEOUT_S:g} s" in error["message"]
    assert lines[2] == "data: [DONE]"
