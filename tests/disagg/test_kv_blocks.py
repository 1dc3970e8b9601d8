"""KV blocks moved between pipelines cut differently: decoding continues exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import pipeline, prefill_here

from ppserve.engine.disagg.kv_blocks import LayerSlice, layer_slices, read_blocks, write_blocks
from ppserve.scheduler.sampling_params import SamplingParams


def test_layer_slices_pair_stages_that_share_layers() -> None:
    prefill = (range(0, 1), range(1, 2), range(2, 4))  # PP=3 as 1,1,2
    decode = (range(0, 3), range(3, 4))  # PP=2 as 3,1
    assert layer_slices(prefill, decode) == [
        LayerSlice(0, 0, range(0, 1)),
        LayerSlice(1, 0, range(1, 2)),
        LayerSlice(2, 0, range(2, 3)),
        LayerSlice(2, 1, range(3, 4)),
    ]
    assert layer_slices((range(0, 4),), decode) == [LayerSlice(0, 0, range(0, 3)), LayerSlice(0, 1, range(3, 4))]
    with pytest.raises(ValueError, match="different layers"):
        layer_slices(prefill, (range(0, 6),))


def test_read_and_write_check_layers_and_shapes() -> None:
    cache = torch.arange(2 * 2 * 4 * 2 * 1 * 3, dtype=torch.float32).view(2, 2, 4, 2, 1, 3)  # layers 5..6
    data = read_blocks(cache, range(5, 7), range(6, 7), [3, 1])
    assert data.shape == (1, 2, 2, 2, 1, 3) and torch.equal(data[0, :, 0], cache[1, :, 3])
    other = torch.zeros_like(cache)
    write_blocks(other, range(5, 7), range(6, 7), [0, 2], data)
    assert torch.equal(other[1, :, 0], cache[1, :, 3]) and torch.equal(other[1, :, 2], cache[1, :, 1])
    assert other[0].abs().sum() == 0  # layer 5 untouched
    with pytest.raises(ValueError, match="not all in this stage"):
        read_blocks(cache, range(5, 7), range(4, 6), [0])
    with pytest.raises(ValueError, match="expected"):
        write_blocks(other, range(5, 7), range(6, 7), [0], data)


@pytest.mark.parametrize(
    ("prefill", "decode"), [((3, "1,1,2"), (2, "3,1")), ((1, None), (2, None)), ((2, None), (1, None))]
)
def test_decode_continues_exactly_after_a_transfer(
    llama_dir: Path, prefill: tuple[int, str | None], decode: tuple[int, str | None]
) -> None:
    """Prefill (and the first token) on one pipeline, KV moved block by block into another with
    different block ids and another layer cut, decoding there: the tokens of one pipeline."""
    prompt = [(i * 37 + 11) % 500 for i in range(45)]  # three blocks of 16, the last one partial
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = pipeline(llama_dir).generate([prompt], params)[0].token_ids

    src = pipeline(llama_dir, prefill[0], layer_partition=prefill[1])
    dst = pipeline(llama_dir, decode[0], layer_partition=decode[1])
    dst.allocator.allocate(3)  # so the decode side's block ids differ from the prefill side's
    p, first = prefill_here(src, prompt, params)  # the whole prompt, and the first token
    assert first == expected[0]

    d = dst.request(prompt, params, "d")
    blocks = dst.scheduler.handover.reserve(d)
    assert blocks is not None and blocks != p.block_table
    for s in layer_slices(src.config.layer_ranges, dst.config.layer_ranges):
        src_cache, dst_cache = src.executor.runners[s.src].kv_cache, dst.executor.runners[s.dst].kv_cache
        data = read_blocks(src_cache, src.config.layer_ranges[s.src], s.layers, p.block_table)
        write_blocks(dst_cache, dst.config.layer_ranges[s.dst], s.layers, blocks, data)
    assert src.scheduler.handover.release(p.request_id)
    dst.scheduler.handover.activate(d.request_id, first)
    dst.run([d])
    assert d.output_token_ids == expected
