"""Small typed ZeroMQ sockets for the control plane (zmq.asyncio, PUSH/PULL).

Each socket has one owner task that reads it; bind or connect is explicit at construction.
LINGER is 0 so that closing never blocks on a peer that has gone away. Across machines a `Guard`
(transport/cluster_key.py) puts the socket under the cluster key: CURVE, and refusals logged.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from ppserve.transport.messages import ControlMsg, Msg, decode, encode

if TYPE_CHECKING:
    from ppserve.transport.cluster_key import Guard


def context() -> zmq.asyncio.Context:
    return zmq.asyncio.Context()


def _open(sock: zmq.asyncio.Socket, address: str, bind: bool, guard: Guard | None) -> str:
    """Bind or connect; returns the address (with the port the OS picked for a "*" port). A
    socket that cannot is closed (an open one would keep its context from terminating)."""
    try:
        return _bind_or_connect(sock, address, bind, guard)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise


def _bind_or_connect(sock: zmq.asyncio.Socket, address: str, bind: bool, guard: Guard | None) -> str:
    if guard is not None:
        guard.keys.apply(sock, server=bind)
    if not bind:
        sock.connect(address)
        return address
    sock.bind(address)
    if guard is not None:
        guard.watch(sock)
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))


class PushSocket:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        *,
        bind: bool,
        guard: Guard | None = None,
        hwm: int = 0,
        immediate: bool = False,
    ) -> None:
        """hwm 0: never drop or block on queue depth (plans are few, and go to our own stages).
        To a peer on another host, a bounded `hwm` and `immediate` (queue only for a connected
        peer) keep a peer that is gone from holding our memory (transport/peers.py)."""
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        if immediate:
            self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.address = _open(self.sock, address, bind, guard)
        self._sync: zmq.Socket[bytes] = zmq.Socket.shadow(self.sock.underlying)
        self._pending: deque[bytes] = deque()  # send_nowait messages waiting for a peer, in order
        self._flusher: asyncio.Task[None] | None = None

    async def send(self, msg: Msg) -> None:
        await self.sock.send(encode(msg), copy=False)

    def send_nowait(self, msg: Msg | bytes) -> None:
        """Send without yielding to the event loop, so that the caller stays atomic. SNDHWM is 0,
        so this only fails when no peer is attached (not yet connected, or gone): the message
        then waits in order, and a task hands it over once a peer is there."""
        data = msg if isinstance(msg, bytes) else encode(msg)
        if not self._pending:
            try:
                self._sync.send(data, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                pass
        self._pending.append(data)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while self._pending:
            await self.sock.send(self._pending[0], copy=False)
            self._pending.popleft()

    def discard_pending(self) -> None:
        """Drop messages still waiting for a peer (they were for a process that is gone)."""
        if self._flusher is not None:
            self._flusher.cancel()
        self._pending.clear()

    async def send_frames(self, frames: Sequence[bytes | memoryview]) -> None:
        await self.sock.send_multipart(frames, copy=False)

    def close(self, linger_ms: int = 0) -> None:
        """linger_ms: how long queued messages may still go out (0: dropped at once)."""
        self.discard_pending()
        self.sock.close(linger=linger_ms)


class PullSocket:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        *,
        bind: bool,
        guard: Guard | None = None,
        max_msg_bytes: int = -1,
    ) -> None:
        """max_msg_bytes: a peer that sends a larger message is disconnected (-1: no limit, for
        our own stages)."""
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
        self.address = _open(self.sock, address, bind, guard)

    async def recv(self) -> ControlMsg:
        frames = await self.recv_frames()
        return decode(frames[0].buffer)

    async def recv_frames(self) -> list[zmq.Frame]:
        while True:
            try:
                frames: list[zmq.Frame] = await self.sock.recv_multipart(copy=False)
                return frames
            except zmq.Again:
                # libzmq may report a socket readable when no whole message is there yet (seen
                # with CURVE under load): nothing was taken, so wait for the next one.
                continue

    def close(self) -> None:
        self.sock.close(linger=0)
