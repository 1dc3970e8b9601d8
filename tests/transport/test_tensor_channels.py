"""Tensor channels copy off the event loop: both ends of an edge in one process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from ppserve.transport.channels import open_channel
from ppserve.transport.control import context
from ppserve.transport.messages import EdgeHeader, Timing
from ppserve.transport.shm_channel import allocate_ring
from ppserve.transport.tensor_channel import ChannelSpec


class Recording(ThreadPoolExecutor):
    """One thread; remembers what ran in it."""

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="copy")
        self.ran: list[str] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        def run() -> Any:
            self.ran.append(threading.current_thread().name)
            return fn(*args, **kwargs)

        return super().submit(run)


@pytest.mark.parametrize("kind", ["shm", "zmq"])
async def test_copies_run_in_the_executor_in_order(kind: str, tmp_path: Path) -> None:
    ring = allocate_ring(2, 1 << 16) if kind == "shm" else None
    spec = ChannelSpec(kind, 0, 1, f"ipc://{tmp_path}/edge", ring)
    ctx = context()
    copies = Recording()
    receiver = open_channel(ctx, spec, sender=False, executor=copies)
    sender = open_channel(ctx, spec, sender=True, executor=copies)
    try:
        # Transposed, so that the zmq channel must copy too (it sends contiguous CPU tensors as is).
        sent = [torch.randn(16, 24).t() for _ in range(5)]  # more than the ring's slots, one at a time
        for mb, tensor in enumerate(sent):
            await sender.send(EdgeHeader(mb, [Timing(0, 0.0, 1.0, 16)]), tensor)
            out = torch.empty(24, 16)
            header = await receiver.recv(out)
            assert header.mb_id == mb and torch.equal(out, tensor)
        assert copies.ran and all(name.startswith("copy") for name in copies.ran)
        assert len(copies.ran) == 2 * len(sent)  # one copy in, one out, per micro-batch
    finally:
        sender.close()
        receiver.close()
        copies.shutdown()
        ctx.term()
