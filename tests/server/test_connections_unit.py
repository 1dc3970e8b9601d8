"""The connection guard in-process, on a bare aiohttp app: the header timeout is its own (the
keep-alive timer here is an hour), and a handler that runs past it is never cut."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from aiohttp import web

from ppserve.server.connections import CONNECTIONS, ConnectionGuard, GuardedSite, connection_limits, read_body

READ_TIMEOUT_S = 2.0  # far above what one loaded loop iteration takes
DEADLINE_S = 30.0  # a connection not closed by then was held, not timed out
REQUEST = b"GET /%s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@dataclass
class Served:
    port: int
    release: asyncio.Event  # lets /slow answer


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await release.wait()  # silent far longer than the read timeout
        return web.Response(text="done")

    async def fast(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    guard = ConnectionGuard(READ_TIMEOUT_S, max_connections=100)
    app = web.Application(
        middlewares=[connection_limits(guard, 1000), read_body(READ_TIMEOUT_S)],
        handler_args={"keepalive_timeout": 3600.0},
    )
    app[CONNECTIONS] = guard
    app.router.add_get("/slow", slow)
    app.router.add_get("/fast", fast)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        await GuardedSite(runner, sock).start()
        yield Served(sock.getsockname()[1], release)
    finally:
        release.set()
        await runner.cleanup()
        sock.close()


async def _until_closed(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.read(), DEADLINE_S)  # read(): everything up to EOF


async def test_requests_that_never_arrive_end_but_running_handlers_do_not(served: Served) -> None:
    open_ = [await asyncio.open_connection("127.0.0.1", served.port) for _ in range(4)]
    (idle_r, _), (kept_r, kept_w), (dribble_r, dribble_w), (slow_r, slow_w) = open_
    slow_w.write(REQUEST % b"slow")
    kept_w.write(REQUEST % b"fast")
    assert (await kept_r.readuntil(b"ok")).startswith(b"HTTP/1.1 200")

    async def dribble() -> None:  # a second request on a kept-alive connection, a byte at a time
        for byte in REQUEST % b"fast":
            dribble_w.write(bytes([byte]))
            await asyncio.sleep(READ_TIMEOUT_S / 5)

    dribble_w.write(REQUEST % b"fast")
    assert (await dribble_r.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
    dribbling = asyncio.create_task(dribble())
    assert await _until_closed(idle_r) == b""  # sent nothing
    assert await _until_closed(dribble_r) == b""  # its headers took longer than the read timeout
    dribbling.cancel()
    # Both outlived the read timeout; the handler that ran meanwhile still answers, and a
    # connection idle after a whole request is left to the keep-alive timer.
    assert not slow_r.at_eof() and not kept_r.at_eof()
    served.release.set()
    assert (await slow_r.readuntil(b"done")).startswith(b"HTTP/1.1 200")
    kept_w.write(REQUEST % b"fast")
    assert (await kept_r.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
    for _, writer in open_:
        writer.close()
