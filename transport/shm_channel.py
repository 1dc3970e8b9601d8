"""Same-host tensors through a ring of shared-memory slots; the header carries the slot index.

The host allocates each edge's ring (a torch tensor in shared memory, handed to both stage
processes when they start), so no named segment exists that a crash could leak.

Why no acknowledgements: the host keeps at most `depth` micro-batches in flight and the ring
has `depth` slots. Micro-batch k + depth is planned only after k's result is back, by which time
the receiver has long copied k's slot out, so a slot is never overwritten while still unread.
After a pipeline reset, headers of voided micro-batches are skipped without reading their slots,
and the count starts again with nothing in flight, so the argument holds within each epoch.
"""

from __future__ import annotations

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
        self, ctx: zmq.asyncio.Context, spec: ChannelSpec, *, sender: bool, guard: Guard | None = None
    ) -> None:
        super().__init__(ctx, spec, sender=sender, guard=guard)
        self._seq = 0  # micro-batches sent: the next slot is _seq % slots

    def _ring(self) -> torch.Tensor:
        assert self.spec.ring is not None, "shm channel without a ring"
        return self.spec.ring

    async def send(self, header: EdgeHeader, tensor: torch.Tensor) -> None:
        assert self.push is not None, "send on the receiving end"
        ring = self._ring()
        data = tensor.detach().contiguous().view(torch.uint8).view(-1)
        if data.numel() > ring.shape[1]:
            raise ValueError(f"activation of {data.numel()} bytes exceeds the shm slot of {ring.shape[1]} bytes")
        slot = self._seq % ring.shape[0]
        self._seq += 1
        ring[slot, : data.numel()].copy_(data)
        await self.push.send_frames([encode(EdgeHeader(header.mb_id, header.timings, slot))])

    async def _recv_into(self, header: EdgeHeader, frames: list[zmq.Frame], out: torch.Tensor) -> None:
        nbytes = out.numel() * out.element_size()
        out.copy_(self._ring()[header.slot, :nbytes].view(out.dtype).view(out.shape))


def allocate_ring(slots: int, slot_bytes: int) -> torch.Tensor:
    """[slots, slot_bytes] uint8 in shared memory, to pass to both stage processes at spawn."""
    return torch.zeros(slots, slot_bytes, dtype=torch.uint8).share_memory_()
