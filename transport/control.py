"""Small typed ZeroMQ sockets for the control plane (zmq.asyncio, PUSH/PULL).

Each socket has one owner task that reads it; bind or connect is explicit at construction.
LINGER is 0 so that closing never blocks on a peer that has gone away.
"""

from __future__ import annotations

from collections.abc import Sequence

import zmq
import zmq.asyncio

from transport.messages import ControlMsg, Msg, decode, encode


def context() -> zmq.asyncio.Context:
    return zmq.asyncio.Context()


class PushSocket:
    def __init__(self, ctx: zmq.asyncio.Context, address: str, *, bind: bool) -> None:
        self.address = address
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block on queue depth: plans are few
        self.sock.bind(address) if bind else self.sock.connect(address)

    async def send(self, msg: Msg) -> None:
        await self.sock.send(encode(msg), copy=False)

    async def send_frames(self, frames: Sequence[bytes | memoryview]) -> None:
        await self.sock.send_multipart(frames, copy=False)

    def close(self, linger_ms: int = 0) -> None:
        """linger_ms: how long queued messages may still go out (0: dropped at once)."""
        self.sock.close(linger=linger_ms)


class PullSocket:
    def __init__(self, ctx: zmq.asyncio.Context, address: str, *, bind: bool) -> None:
        self.address = address
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.bind(address) if bind else self.sock.connect(address)

    async def recv(self) -> ControlMsg:
        frame: zmq.Frame = await self.sock.recv(copy=False)
        return decode(frame.buffer)

    async def recv_frames(self) -> list[zmq.Frame]:
        frames: list[zmq.Frame] = await self.sock.recv_multipart(copy=False)
        return frames

    def close(self) -> None:
        self.sock.close(linger=0)
