"""torch.distributed point-to-point tensors (gloo on CPU, nccl on CUDA); header over ZeroMQ.

gloo's work handles cannot be polled, so waits run in a worker thread and never block the event
loop. Both ends issue operations in micro-batch order, which pairs each send with its recv.
Each stage process joins one process group (rank = stage) before opening its channels.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import zmq
import zmq.asyncio

from ppserve.transport.messages import EdgeHeader
from ppserve.transport.tensor_channel import ChannelSpec, TensorChannel

if TYPE_CHECKING:
    from ppserve.transport.cluster_key import Guard


class DistChannel(TensorChannel):
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        spec: ChannelSpec,
        *,
        sender: bool,
        guard: Guard | None = None,
        executor: Executor | None = None,
    ) -> None:
        super().__init__(ctx, spec, sender=sender, guard=guard, executor=executor)
        if not dist.is_initialized():
            raise RuntimeError(f"{spec.kind} channel: torch.distributed is not initialised in this process")
        self.peer = spec.dst if sender else spec.src
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{spec.kind}-wait")

    async def send(self, header: EdgeHeader, tensor: torch.Tensor, ready: torch.cuda.Event | None = None) -> None:
        # No copy here: the backend reads the tensor itself (NCCL on its stream, after the
        # current stream's work; gloo in its own threads).
        work = dist.isend(tensor.detach().contiguous(), dst=self.peer)
        await super().send(header, tensor)
        assert work is not None
        await asyncio.get_running_loop().run_in_executor(self._waiter, work.wait)

    async def recv(self, out: torch.Tensor, skip_before: int = 0) -> EdgeHeader:
        """The receive is posted before the header is awaited: the receiver knows the shape from
        the plan, and gloo's sender waits for the receiver's "ready" before it sends, so posting
        early takes that round trip off the hop (three one-way delays become one)."""
        work = dist.irecv(out, src=self.peer)
        assert work is not None
        header, _ = await self._next_header(skip_before)
        await asyncio.get_running_loop().run_in_executor(self._waiter, work.wait)
        return header

    async def _recv_into(self, header: EdgeHeader, frames: list[zmq.Frame], out: torch.Tensor) -> None:
        raise AssertionError("DistChannel receives in recv()")

    async def warm_up(self) -> None:
        """One element across the edge, before any micro-batch: NCCL creates a pair's
        communicator at its first operation, which would otherwise be the first micro-batch."""
        device = "cuda" if self.spec.kind == "nccl" else "cpu"  # NCCL: the stage's current device
        token = torch.zeros(1, device=device)
        work = dist.isend(token, dst=self.peer) if self.sender else dist.irecv(token, src=self.peer)
        assert work is not None
        await asyncio.get_running_loop().run_in_executor(self._waiter, work.wait)

    def close(self, linger_ms: int = 0) -> None:
        super().close(linger_ms)
        self._waiter.shutdown(wait=False, cancel_futures=True)


def init_process_group(
    kind: str,
    rank: int,
    world_size: int,
    master: str,
    port: int,
    timeout_s: float = 60,
    device_id: torch.device | None = None,
    store_prefix: str | None = None,
) -> None:
    """Join the stages' group. `device_id` (the stage's GPU, for nccl) binds the group to that
    device, so NCCL sets up at once rather than inside the first send. `store_prefix`: meet
    through the existing store at master:port (a cluster's rendezvous store, run by the host),
    under this prefix; else rank 0 starts a store there."""
    from datetime import timedelta

    timeout = timedelta(seconds=timeout_s)
    if store_prefix is None:
        dist.init_process_group(
            backend=kind,
            init_method=f"tcp://{master}:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device_id,
        )
        return
    store = dist.PrefixStore(store_prefix, dist.TCPStore(master, port, is_master=False, timeout=timeout))
    dist.init_process_group(
        backend=kind, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id
    )
