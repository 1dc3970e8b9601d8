"""The test TCP proxy (tests/tcp_proxy.py) does what multi-node and disaggregation tests rely on:
bytes arrive whole and in order, never earlier than the injected delay, and connections can be
dropped or refused."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from tcp_proxy import TcpProxy


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(4096):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    yield int(server.sockets[0].getsockname()[1])
    server.close()
    await server.wait_closed()


@pytest.fixture
async def proxy(echo_port: int) -> AsyncIterator[TcpProxy]:
    proxy = TcpProxy("127.0.0.1", echo_port, delay_s=0.02, jitter_s=0.01, seed=3)
    await proxy.start()
    yield proxy
    await proxy.close()


async def _connect(proxy: TcpProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", proxy.port)


async def test_bytes_arrive_in_order_and_never_early(proxy: TcpProxy) -> None:
    reader, writer = await _connect(proxy)
    messages = [f"{i:05d};".encode() for i in range(300)]
    for m in messages:  # many small writes: many chunks, each with its own jitter
        writer.write(m)
        await writer.drain()
    received = await reader.readexactly(sum(map(len, messages)))
    assert received == b"".join(messages)
    writer.close()
    assert {d.direction for d in proxy.log} == {"up", "down"}
    assert all(d.written_at - d.read_at >= proxy.delay_s for d in proxy.log)
    for direction in ("up", "down"):
        written = [d.written_at for d in proxy.log if d.direction == direction]
        assert written == sorted(written)


async def test_dropped_and_refused_connections(proxy: TcpProxy) -> None:
    reader, writer = await _connect(proxy)
    writer.write(b"ping")
    assert await reader.readexactly(4) == b"ping"
    assert proxy.connections == 1
    proxy.drop_all()
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        await reader.readexactly(1)  # reset or closed: the link is gone
    writer.close()

    proxy.refuse = True  # the peer is down: a new connection is closed at once
    reader, writer = await _connect(proxy)
    with contextlib.suppress(ConnectionResetError):  # closed with a reset: refused just the same
        assert await reader.read(1) == b""
    writer.close()

    proxy.refuse = False  # and back up
    reader, writer = await _connect(proxy)
    writer.write(b"again")
    assert await reader.readexactly(5) == b"again"
    writer.close()
