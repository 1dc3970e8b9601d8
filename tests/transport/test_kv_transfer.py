"""KV blocks over the zmq transfer backend: chunked by whole blocks, reassembled exactly."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ppserve.engine.disagg.kv_blocks import layer_slices, read_blocks, write_blocks
from ppserve.transport.cluster_key import CurveKeys, Guard
from ppserve.transport.control import context
from ppserve.transport.kv_transfer import KvChunk, block_chunks, open_receiver, open_sender


def test_block_chunks_are_runs_of_whole_blocks() -> None:
    assert list(block_chunks(10, 1 << 20, 4 << 20)) == [(0, 4), (4, 4), (8, 2)]
    assert list(block_chunks(3, 8 << 20, 4 << 20)) == [(0, 1), (1, 1), (2, 1)]  # a block is never split
    assert list(block_chunks(0, 100)) == []


@pytest.mark.parametrize("secured", [False, True])
async def test_a_stage_pair_streams_its_shared_layers_block_by_block(
    secured: bool, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    # Prefill stage 1 holds layers 2..4, decode stage 0 holds layers 0..3: they share 2 and 3.
    src_own, dst_own = range(2, 5), range(0, 4)
    src_cache = torch.randn(3, 2, 8, 4, 2, 3)
    dst_cache = torch.zeros(4, 2, 8, 4, 2, 3)
    [pair] = [s for s in layer_slices((range(0, 2), src_own), (dst_own, range(4, 5))) if (s.src, s.dst) == (1, 0)]
    src_blocks, dst_blocks = [5, 1, 7, 2, 6], [0, 3, 2, 4, 1]
    ctx = context()
    guard = Guard(ctx, CurveKeys.from_secret(b"a-secret-for-the-kv-test"), "test") if secured else None
    receiver = open_receiver("zmq", ctx, "tcp://127.0.0.1:*", guard)
    sender = open_sender("zmq", ctx, receiver.address, guard)
    try:
        # On the sender's own connection, so it arrives before the chunks: dropped by the receiver, logged.
        await sender.push.send_frames([b"not a chunk", b"\x00"])  # type: ignore[attr-defined]

        per_block = src_cache[0:1, :, 0:1].numel() * len(pair.layers) * src_cache.element_size()
        runs = list(block_chunks(len(src_blocks), per_block, max_bytes=2 * per_block))
        assert len(runs) == 3
        for offset, count in runs:
            data = read_blocks(src_cache, src_own, pair.layers, src_blocks[offset : offset + count])
            chunk = KvChunk(
                "room",
                1,
                pair.layers.start,
                pair.layers.stop,
                offset,
                count,
                len(src_blocks),
                "float32",
                tuple(data.shape),
            )
            await sender.send(chunk, data)
        received = 0
        while received < len(src_blocks):
            chunk, data = await asyncio.wait_for(receiver.recv(), 10)
            into = dst_blocks[chunk.block_offset : chunk.block_offset + chunk.num_blocks]
            write_blocks(dst_cache, dst_own, range(chunk.layer_start, chunk.layer_stop), into, data)
            received += chunk.num_blocks
        for s, d in zip(src_blocks, dst_blocks, strict=True):
            assert torch.equal(dst_cache[2:4, :, d], src_cache[0:2, :, s])
        assert dst_cache[0:2].abs().sum() == 0  # layers the pair does not share are untouched
        assert any("dropped a malformed KV chunk" in r.message for r in caplog.records)
        with pytest.raises(ValueError, match="header says"):
            await sender.send(chunk, torch.zeros(1))
        with pytest.raises(ValueError, match="unknown KV transfer backend"):
            open_sender("rdma", ctx, receiver.address)
    finally:  # a failed check must not leave a socket open: the context's term() would wait for it
        sender.close()
        receiver.close()
        if guard is not None:
            guard.stop()
        ctx.term()
