"""KV transfer between a prefill stage and a decode stage (prefill/decode disaggregation).

A prefill stage sends the KV of the layers it shares with a decode stage (engine/disagg/kv_blocks.py)
in chunks of whole blocks, so a long prompt streams out block by block and the receiver writes
each chunk into the blocks it allocated as soon as it arrives. The backend is pluggable: `zmq`
(frames over a PUSH/PULL pair, CPU memory, works across hosts and under the cluster key) is the
one here; a GPU backend (NCCL, NIXL, Mooncake) implements the same two classes.

Each chunk carries a small header (`KvChunk`): the room, the sending stage, its layers, which of
the room's blocks it holds, and how many blocks the transfer has in all, so the receiver knows
when a stage pair is complete without any other message.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator
from concurrent.futures import Executor
from typing import TYPE_CHECKING

import msgspec
import torch
import zmq.asyncio

from ppserve.transport.control import PullSocket, PushSocket
from ppserve.transport.peers import LogLimiter

if TYPE_CHECKING:
    from ppserve.transport.cluster_key import Guard

log = logging.getLogger("ppserve.kv")
CHUNK_BYTES = 4 << 20  # per message: large enough to amortise a send, small enough to stream
SEND_QUEUE = 4  # chunks queued per receiver: a receiver that is gone holds up at most these


class KvChunk(msgspec.Struct, frozen=True, array_like=True):
    room: str
    src_stage: int
    layer_start: int  # global layer indices [layer_start, layer_stop)
    layer_stop: int
    block_offset: int  # the first block's index in the room's block table
    num_blocks: int
    total_blocks: int  # the room's blocks in all: the pair is complete when they all arrived
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]  # of one chunk's data: [layers, 2, num_blocks, block_size, kv_heads, head_dim]


_chunk_decoder = msgspec.msgpack.Decoder(KvChunk)
_encoder = msgspec.msgpack.Encoder()


def block_chunks(total_blocks: int, bytes_per_block: int, max_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, int]]:
    """(offset, count) runs of whole blocks, each at most `max_bytes` (one block at least)."""
    per_chunk = max(1, max_bytes // max(1, bytes_per_block))
    for offset in range(0, total_blocks, per_chunk):
        yield offset, min(per_chunk, total_blocks - offset)


class KvSender(ABC):
    @abstractmethod
    async def send(self, chunk: KvChunk, data: torch.Tensor) -> None:
        """Send one chunk (`data`: the blocks `chunk` describes, as read_blocks made them)."""

    @abstractmethod
    def close(self) -> None: ...


class KvReceiver(ABC):
    address: str  # where senders reach it (given to the prefill side in the handshake)

    @abstractmethod
    async def recv(self) -> tuple[KvChunk, torch.Tensor]:
        """The next chunk from any sender, its data as a CPU tensor of `chunk.shape` (it may
        borrow the received message's memory: copy it before writing to it)."""

    @abstractmethod
    def close(self) -> None: ...


def _host_copy(data: torch.Tensor) -> torch.Tensor:
    return data.contiguous().cpu()


class ZmqKvSender(KvSender):
    def __init__(
        self, ctx: zmq.asyncio.Context, address: str, guard: Guard | None = None, executor: Executor | None = None
    ) -> None:
        self.executor = executor  # where copies to host memory run (None: the loop's default executor)
        # Only to a receiver that is connected (and proved the key), a few chunks deep: a send to
        # one that is not there blocks, and the exporter's timeout fails the transfer.
        self.push = PushSocket(ctx, address, bind=False, guard=guard, hwm=SEND_QUEUE, immediate=True)

    async def send(self, chunk: KvChunk, data: torch.Tensor) -> None:
        if tuple(data.shape) != chunk.shape:
            raise ValueError(f"KV chunk data of shape {tuple(data.shape)}, header says {chunk.shape}")
        raw = data.detach()
        if raw.is_cuda or not raw.is_contiguous():
            # A copy of a few MB (on CUDA one that waits for the GPU): never on the event loop.
            raw = await asyncio.get_running_loop().run_in_executor(self.executor, _host_copy, raw)
        # The frame borrows the tensor's memory; zmq keeps a reference until it is sent.
        await self.push.send_frames([_encoder.encode(chunk), raw.view(torch.uint8).numpy().data])

    def close(self) -> None:
        self.push.close(linger_ms=500)  # chunks still queued go out (briefly)


class ZmqKvReceiver(KvReceiver):
    def __init__(self, ctx: zmq.asyncio.Context, address: str, guard: Guard | None = None) -> None:
        self.pull = PullSocket(ctx, address, bind=True, guard=guard)
        self.address = self.pull.address
        self.junk = LogLimiter(log)

    async def recv(self) -> tuple[KvChunk, torch.Tensor]:
        while True:
            frames = await self.pull.recv_frames()
            try:
                chunk = _chunk_decoder.decode(frames[0].buffer)
                dtype = getattr(torch, chunk.dtype)
                data = torch.frombuffer(frames[1].buffer, dtype=torch.uint8).view(dtype).view(chunk.shape)
            except (msgspec.DecodeError, AttributeError, IndexError, RuntimeError, TypeError, ValueError) as e:
                # Not a KV chunk, or a malformed one: dropped, never written anywhere.
                self.junk.warning("dropped a malformed KV chunk on %s (%s: %s)", self.address, type(e).__name__, e)
                continue
            # No copy here: the tensor keeps the frame (and its memory) alive, and the one copy
            # that is needed, into the cache, runs where the cache is written (write_blocks).
            return chunk, data

    def close(self) -> None:
        self.pull.close()


def open_sender(
    backend: str, ctx: zmq.asyncio.Context, address: str, guard: Guard | None = None, executor: Executor | None = None
) -> KvSender:
    """`executor`: where copies to host memory run, off the event loop."""
    if backend == "zmq":
        return ZmqKvSender(ctx, address, guard, executor)
    raise ValueError(f"unknown KV transfer backend {backend!r} (available: zmq)")


def open_receiver(backend: str, ctx: zmq.asyncio.Context, address: str, guard: Guard | None = None) -> KvReceiver:
    if backend == "zmq":
        return ZmqKvReceiver(ctx, address, guard)
    raise ValueError(f"unknown KV transfer backend {backend!r} (available: zmq)")
