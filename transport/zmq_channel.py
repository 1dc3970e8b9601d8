"""Tensors as zero-copy ZeroMQ frames beside the header: works across hosts, needs no setup."""

from __future__ import annotations

import torch
import zmq

from ppserve.transport.messages import EdgeHeader, encode
from ppserve.transport.tensor_channel import TensorChannel


class ZmqChannel(TensorChannel):
    async def send(self, header: EdgeHeader, tensor: torch.Tensor, ready: torch.cuda.Event | None = None) -> None:
        assert self.push is not None, "send on the receiving end"
        data = tensor.detach()
        if data.is_cuda or not data.is_contiguous():  # a copy: in the copy executor (see TensorChannel)
            host = torch.empty(data.shape, dtype=data.dtype)
            await self._off_loop(self._to_host, host, data, ready)
            data = host
        # The frame borrows the tensor's memory (no copy); zmq holds a reference until sent.
        await self.push.send_frames([encode(header), data.view(torch.uint8).numpy().data])

    async def _recv_into(self, header: EdgeHeader, frames: list[zmq.Frame], out: torch.Tensor) -> None:
        src = torch.frombuffer(frames[1].buffer, dtype=torch.uint8).view(out.dtype).view(out.shape)
        await self._off_loop(out.copy_, src)
