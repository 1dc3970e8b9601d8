"""Same-host tensors through a ring of shared-memory slots; the header carries the slot index.

The host allocates each edge's ring (a torch tensor in shared memory, handed to both stage
processes when they start), so no named segment exists that a crash could leak.

Why no acknowledgements: the host keeps at most `depth` micro-batches in flight and the ring
has `depth` slots. Micro-batch k + depth is planned only after k's result is back, by which time
the receiver has long copied k's slot out, so a slot is never overwritten while still unread.
After a pipeline reset, headers of voided micro-batches are skipped without reading their slots,
and the count starts again with nothing in flight, so the argument holds within each epoch.

Copies into and out of a slot run in the channel's copy executor, never on the event loop (a
slot holds up to tens of MB). Their order: a copy into a slot completes before its doorbell is
sent (the receiver may read the slot as soon as the doorbell arrives); a copy out of a slot
completes before `recv` returns, so before the plan computes, and so before its result can
free the slot for a later micro-batch. A single-thread executor runs copies in the order they
were asked for, so a copy left running by a cancelled send (a reset) is done before the next.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import TYPE_CHECKING

import torch
import zmq
import zmq.asyncio

from ppserve.transport.messages import EdgeHeader, encode
from ppserve.transport.tensor_channel import ChannelSpec, TensorChannel

if TYPE_CHECKING:
    from ppserve.transport.cluster_key import Guard


class ShmChannel(TensorChannel):
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
        self._seq = 0  # micro-batches sent: the next slot is _seq % slots

    def _ring(self) -> torch.Tensor:
        assert self.spec.ring is not None, "shm channel without a ring"
        return self.spec.ring

    async def send(self, header: EdgeHeader, tensor: torch.Tensor, ready: torch.cuda.Event | None = None) -> None:
        assert self.push is not None, "send on the receiving end"
        ring = self._ring()
        data = tensor.detach()
        nbytes = data.numel() * data.element_size()
        if nbytes > ring.shape[1]:
            raise ValueError(f"activation of {nbytes} bytes exceeds the shm slot of {ring.shape[1]} bytes")
        slot = self._seq % ring.shape[0]
        self._seq += 1
        await self._off_loop(self._to_host, _slot_view(ring, slot, data), data, ready)  # then the doorbell
        await self.push.send_frames([encode(EdgeHeader(header.mb_id, header.timings, slot))])

    async def _recv_into(self, header: EdgeHeader, frames: list[zmq.Frame], out: torch.Tensor) -> None:
        await self._off_loop(out.copy_, _slot_view(self._ring(), header.slot, out))


def _slot_view(ring: torch.Tensor, slot: int, like: torch.Tensor) -> torch.Tensor:
    """The start of `slot` seen as a host tensor of `like`'s shape and dtype."""
    nbytes = like.numel() * like.element_size()
    return ring[slot, :nbytes].view(like.dtype).view(like.shape)


def allocate_ring(slots: int, slot_bytes: int) -> torch.Tensor:
    """[slots, slot_bytes] uint8 in shared memory, to pass to both stage processes at spawn."""
    return torch.zeros(slots, slot_bytes, dtype=torch.uint8).share_memory_()
