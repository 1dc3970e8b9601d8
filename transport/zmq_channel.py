"""Tensors as zero-copy ZeroMQ frames beside the header: works across hosts, needs no setup."""

from __future__ import annotations

import torch
import zmq

from transport.messages import EdgeHeader, encode
from transport.tensor_channel import TensorChannel


class ZmqChannel(TensorChannel):
    async def send(self, header: EdgeHeader, tensor: torch.Tensor) -> None:
        assert self.push is not None, "send on the receiving end"
        data = tensor.detach().contiguous().cpu()
        # The frame borrows the tensor's memory (no copy); zmq holds a reference until sent.
        await self.push.send_frames([encode(header), data.view(torch.uint8).numpy().data])

    async def _recv_tensor(
        self,
        header: EdgeHeader,
        frames: list[zmq.Frame],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        # Own the memory (clone) rather than keep the zmq frame alive for the tensor's lifetime.
        flat = torch.frombuffer(frames[1].buffer, dtype=torch.uint8)
        return flat.view(dtype).view(shape).to(device=device, copy=True)
