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

KINDS = ("auto", "shm", "gloo", "nccl", "zmq")
T = TypeVar("T")


@dataclass(frozen=True)
class ChannelSpec:
    """Everything both ends of one edge need; made by the host, pickled to the stage processes."""

    kind: str  # resolved: shm | gloo | nccl | zmq
    src: int  # sending rank (a stage index in the pipeline)
    dst: int  # receiving rank
    address: str  # ZeroMQ address of the header socket (bound by the receiver)
    ring: torch.Tensor | None = None  # shm: [slots, slot_bytes] uint8 in shared memory


def resolve_kind(kind: str, device: str, same_host: bool, shared_gpu: bool = False) -> str:
    """One edge's kind. `same_host`: both ends on one node; `shared_gpu`: some GPU of the
    pipeline holds two stages (NCCL then refuses the whole group). `auto`: nccl between CUDA
    stages each on its own GPU; otherwise shm within a node (on a shared GPU, through host
    memory), and across nodes gloo on CPU or zmq on CUDA."""
    if kind not in KINDS:
        raise ValueError(f"tensor transport must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "auto":
        if device == "cuda" and not shared_gpu:
            return "nccl"
        if same_host:
            return "shm"
        return "zmq" if device == "cuda" else "gloo"
    if kind == "nccl" and device != "cuda":
        raise ValueError("tensor transport 'nccl' needs --device cuda")
    if kind == "nccl" and shared_gpu:
        raise ValueError("tensor transport 'nccl' needs each stage on its own GPU (NCCL refuses two on one)")
    if kind == "shm" and not same_host:
        raise ValueError("tensor transport 'shm' works within one node only (use auto, gloo or zmq across nodes)")
    return kind


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


def open_channel(
    ctx: zmq.asyncio.Context,
    spec: ChannelSpec,
    *,
    sender: bool,
    guard: Guard | None = None,
    executor: Executor | None = None,
) -> TensorChannel:
    """One end of an edge: `sender` for rank `spec.src`, else for rank `spec.dst`; `guard`: the
    cluster key, across nodes; `executor`: where tensor copies run (see TensorChannel)."""
    if spec.kind == "shm":
        from ppserve.transport.shm_channel import ShmChannel

        return ShmChannel(ctx, spec, sender=sender, guard=guard, executor=executor)
    if spec.kind in ("gloo", "nccl"):
        from ppserve.transport.dist_channel import DistChannel

        return DistChannel(ctx, spec, sender=sender, guard=guard, executor=executor)
    if spec.kind == "zmq":
        from ppserve.transport.zmq_channel import ZmqChannel

        return ZmqChannel(ctx, spec, sender=sender, guard=guard, executor=executor)
    raise ValueError(f"unknown tensor channel kind {spec.kind!r}")
