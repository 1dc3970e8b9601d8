"""Tensor channels: how activations travel from stage i to stage i + 1.

Every channel is one edge, one direction, FIFO: the k-th `recv` returns the k-th `send` (after a
pipeline reset, the receiver skips what was sent for micro-batches the reset voided). A small
`EdgeHeader` always travels over a ZeroMQ PUSH/PULL pair (micro-batch id, upstream timings); the
tensor goes by the channel's own means. Shapes are not sent: the receiver knows them from the plan.

Kinds (`--tensor-transport`):
  shm   same host: a ring of slots in shared memory per edge, the header is the doorbell.
  gloo  torch.distributed point-to-point on CPU; nccl: the same on CUDA.
  zmq   the tensor as a zero-copy frame next to the header (works across hosts).
  auto  per edge: nccl between CUDA stages (each on its own GPU), shm within a node, else gloo
        between CPU nodes (zmq between CUDA nodes whose GPUs are shared within a node).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
import zmq.asyncio

from ppserve.transport.control import PullSocket, PushSocket
from ppserve.transport.messages import EdgeHeader, decode_header, encode

if TYPE_CHECKING:
    from ppserve.transport.cluster_key import Guard

T = TypeVar("T")


@dataclass(frozen=True)
class ChannelSpec:
    """Everything both ends of one edge need; made by the host, pickled to the stage processes."""

    kind: str  # resolved: shm | gloo | nccl | zmq
    src: int  # sending rank (a stage index in the pipeline)
    dst: int  # receiving rank
    address: str  # ZeroMQ address of the header socket (bound by the receiver)
    ring: torch.Tensor | None = None  # shm: [slots, slot_bytes] uint8 in shared memory


class TensorChannel(ABC):
    """`executor`: where copies of a tensor's bytes run (one thread, so that they run in the
    order they are asked for); never on the event loop, which would stall every socket of the
    process for as long as a copy of up to tens of MB takes, and on CUDA until the GPU has
    finished whatever was queued before it. None: a thread of the channel's own."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        spec: ChannelSpec,
        *,
        sender: bool,
        guard: Guard | None = None,
        executor: Executor | None = None,
    ) -> None:
        self.spec = spec
        self.sender = sender
        self.push = PushSocket(ctx, spec.address, bind=False, guard=guard) if sender else None
        self.pull = None if sender else PullSocket(ctx, spec.address, bind=True, guard=guard)
        self._executor = executor
        self._own_executor: ThreadPoolExecutor | None = None
        self._copy_stream: torch.cuda.Stream | None = None

    async def send(self, header: EdgeHeader, tensor: torch.Tensor, ready: torch.cuda.Event | None = None) -> None:
        """Send `tensor` (contents read after this returns do not matter: it was copied or sent).
        `ready`, on CUDA: an event after the kernels that produced it; the copy then waits for
        that event only, not for work queued after it (the next micro-batch's kernels)."""
        assert self.push is not None, "send on the receiving end"
        await self.push.send_frames([encode(header)])

    async def _off_loop(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` in the copy executor; copies are awaited one at a time per channel."""
        if self._executor is None:
            # The creating thread's torch thread count: a new thread would otherwise start as
            # many OpenMP threads as there are cores.
            threads = torch.get_num_threads()
            self._executor = self._own_executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="channel-copy", initializer=torch.set_num_threads, initargs=(threads,)
            )
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _to_host(self, dst: torch.Tensor, src: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        """Copy executor: host tensor `dst` <- `src` (same shape and dtype). A CUDA `src` with a
        `ready` event is read on a stream of the channel's own that waits for that event only:
        on the current stream the copy would wait for everything queued there before it. The
        copy into host memory is synchronous, so `src` may be freed once this returns."""
        if not src.is_cuda or ready is None:
            dst.copy_(src)
            return
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=src.device)
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(ready)
            dst.copy_(src)

    async def warm_up(self) -> None:  # noqa: B027 (a hook: most channels have nothing to set up)
        """Set up whatever the first micro-batch would otherwise set up (see DistChannel)."""

    async def recv(self, out: torch.Tensor, skip_before: int = 0) -> EdgeHeader:
        """Receive the next tensor into `out` (its shape, dtype and device say what to expect).
        Micro-batches numbered below `skip_before` (the first of the current epoch) are dropped
        unread: they were sent for plans that a pipeline reset voided. Channels whose tensors
        travel apart from the header (gloo, nccl) never see such leftovers: every stage is
        replaced together."""
        header, frames = await self._next_header(skip_before)
        await self._recv_into(header, frames, out)
        return header

    async def _next_header(self, skip_before: int) -> tuple[EdgeHeader, list[zmq.Frame]]:
        assert self.pull is not None, "recv on the sending end"
        while True:
            frames = await self.pull.recv_frames()
            header = decode_header(frames[0].buffer)
            if header.mb_id >= skip_before:
                return header, frames

    @abstractmethod
    async def _recv_into(self, header: EdgeHeader, frames: list[zmq.Frame], out: torch.Tensor) -> None: ...

    def close(self, linger_ms: int = 0) -> None:
        if self.push is not None:
            self.push.close(linger_ms)
        if self.pull is not None:
            self.pull.close()
        if self._own_executor is not None:
            self._own_executor.shutdown(wait=False, cancel_futures=True)
