"""The CPU fast paths against the plain torch they replace: the decode-attention kernel over the
paged cache, and fused, oneDNN-packed linear layers."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ppserve.engine.model import attention, decode_attention
from ppserve.engine.model.attention import AttentionMetadata, paged_attention
from ppserve.engine.model.linear import Linear, fuse_linears, onednn_packs

pytestmark = pytest.mark.skipif(decode_attention.load() is None, reason="no C++ compiler")


def reference(q, k_cache, v_cache, tables, lens, scale, window):  # type: ignore[no-untyped-def]
    """SDPA over each request's gathered keys, one request at a time."""
    out = []
    block_size = k_cache.shape[1]
    for b in range(q.shape[0]):
        n = int(lens[b])
        keys = k_cache[tables[b]].flatten(0, 1)[:n]  # [n, kv_heads, head_dim]
        values = v_cache[tables[b]].flatten(0, 1)[:n]
        lo = max(0, n - window) if window else 0
        keys, values = keys[lo:], values[lo:]
        o = F.scaled_dot_product_attention(
            q[b][:, None, :].float(),
            keys.transpose(0, 1).float(),
            values.transpose(0, 1).float(),
            scale=scale,
            enable_gqa=True,
        )
        out.append(o[:, 0, :])
        assert tables.shape[1] * block_size >= n
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 4, 64), (14, 2, 64), (4, 4, 32), (6, 1, 16)])
@pytest.mark.parametrize("window", [None, 1, 5, 40])
def test_kernel_matches_sdpa(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, window: int | None) -> None:
    rng = random.Random(heads * 100 + (window or 0))
    gen = torch.Generator().manual_seed(rng.randrange(1000))
    block_size, num_blocks, batch = 4, 64, 7
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor([1, 2, 3, 4, 5, 37, 60][:batch], dtype=torch.long)
    width = -(-int(lens.max()) // block_size)
    # Each request's blocks are a random, non-contiguous pick; the padding is block 0.
    tables = torch.zeros(batch, width, dtype=torch.long)
    for b, n in enumerate(lens.tolist()):
        tables[b, : -(-n // block_size)] = torch.tensor(rng.sample(range(num_blocks), -(-n // block_size)))
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    got = decode_attention.decode_attention(q, k_cache, v_cache, tables, lens, scale, window)
    want = reference(q, k_cache, v_cache, tables, lens, scale, window)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_paged_attention_same_with_and_without_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed batch (prefill chunks and decodes, in any order) through both decode paths."""

    class Span:
        def __init__(self, start: int, num_new: int, table: list[int]) -> None:
            self.start, self.num_new, self.block_table = start, num_new, table

    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(2, 40, 4, 2, 16, generator=gen)
    spans = [Span(9, 1, [5, 2, 7]), Span(0, 6, [1, 3]), Span(3, 1, [0]), Span(20, 1, [8, 9, 10, 11, 12, 13])]
    md = AttentionMetadata.build(spans, 4, torch.device("cpu"), windows=(None, 3))
    q = torch.randn(sum(s.num_new for s in spans), 4, 16, generator=gen)
    for window in (None, 3):
        fast = paged_attention(q, k_cache, v_cache, md, 0.25, window)
        monkeypatch.setattr(attention.kernel, "available", lambda device, dtype: False)
        slow = paged_attention(q, k_cache, v_cache, md, 0.25, window)
        monkeypatch.undo()
        torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_packed_linear_matches_separate(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(48, 32, bias=True), nn.Linear(48, 16, bias=False), nn.Linear(48, 8, bias=True)]
    layers = [lin.to(dtype) for lin in layers]
    fused = fuse_linears(layers, dtype, torch.device("cpu"))
    assert isinstance(fused, Linear) and fused.out_features == 56
    assert fused.packed == onednn_packs(torch.device("cpu"), dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in (1, 3, 64, 200):  # the packed weight serves any number of rows
        x = torch.randn(rows, 48).to(dtype)
        want = torch.cat([lin(x) for lin in layers], dim=-1)
        torch.testing.assert_close(fused(x).float(), want.float(), atol=tol, rtol=tol)
