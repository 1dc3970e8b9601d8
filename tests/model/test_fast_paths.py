"""The CPU fast paths against the plain torch they replace: the kernels of engine/model/cpu_kernels.cpp
(decode attention over the paged cache, residual add with RMSNorm, SiLU * up, RoPE with the cache
write), fused linear layers, and ppserve's float32 GEMM."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ppserve.engine.model import attention, cpu_kernels
from ppserve.engine.model.attention import AttentionMetadata
from ppserve.engine.model.attention_backend import AttentionBackend
from ppserve.engine.model.attention_choice import choose_attention
from ppserve.engine.model.attention_sdpa import SdpaAttention
from ppserve.engine.model.linear import MIN_ROWS, Linear, default_kernel, fuse_linears, onednn_rows
from ppserve.engine.model.model import RMSNorm
from ppserve.engine.model.model_config import RopeConfig
from ppserve.engine.model.quantized import GROUP, QuantLinear, QuantWeight, quantize_int8
from ppserve.engine.model.rope import apply_rope, rope_inv_freq

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C++ compiler")


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
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(8, 4, 64), (14, 2, 64), (4, 2, 128), (4, 1, 256), (4, 4, 32), (6, 1, 16)]
)
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
    got = cpu_kernels.decode_attention(q, k_cache, v_cache, tables, lens, scale, window)
    want = reference(q, k_cache, v_cache, tables, lens, scale, window)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def prefill_reference(q, k, v, batch, scale, window):  # type: ignore[no-untyped-def]
    """Causal attention in float64, prompt by prompt: query i of nq at position nk - nq + i."""
    out = []
    group = q.shape[1] // k.shape[1]
    for qb, kb, vb in zip(q.chunk(batch), k.chunk(batch), v.chunk(batch), strict=True):
        nq, nk = qb.shape[0], kb.shape[0]
        q_pos, k_pos = torch.arange(nk - nq, nk)[:, None], torch.arange(nk)[None, :]
        allowed = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        keys, values = (t.double().transpose(0, 1).repeat_interleave(group, 0) for t in (kb, vb))
        scores = (qb.double().transpose(0, 1) @ keys.transpose(1, 2) * scale).masked_fill(~allowed, float("-inf"))
        out.append((scores.softmax(-1) @ values).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.skipif(
    not cpu_kernels.prefill_available(torch.device("cpu"), torch.float32, 64), reason="no prefill kernel in this build"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (14, 2, 64), (4, 2, 128), (8, 8, 64)])
@pytest.mark.parametrize(
    ("batch", "nq", "nk", "window"),
    [
        (3, 37, 37, None),
        (1, 1, 1, None),
        (1, 300, 300, None),
        (2, 20, 53, None),
        (1, 5, 100, 7),
        (2, 64, 64, 17),
        (2, 40, 300, 50),  # a chunk after a prefix, its queries' windows starting at different key tiles
    ],
)
def test_prefill_kernel_matches_reference(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, batch: int, nq: int, nk: int, window: int | None
) -> None:
    """Fresh prompts (nq == nk, several in one call), chunks after a prefix, sliding windows; q, k
    and v the strided views of one projection, as a layer hands them over."""
    gen = torch.Generator().manual_seed(heads * nk + nq)
    qkv = torch.randn(batch * nk, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k, v = k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim)
    q = q.view(-1, heads, head_dim) if nq == nk else torch.randn(batch * nq, heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    got = cpu_kernels.prefill_attention(q, k, v, batch, scale, window)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), prefill_reference(q, k, v, batch, scale, window), atol=tol, rtol=tol)
    # Each prompt's rows are those of a call of its own.
    for b in range(batch):
        alone = cpu_kernels.prefill_attention(q.chunk(batch)[b], k.chunk(batch)[b], v.chunk(batch)[b], 1, scale, window)
        assert torch.equal(alone, got.chunk(batch)[b])


@pytest.mark.parametrize("head_dim", [16, 64])  # SDPA's prefill, and the kernel's where it has one
def test_attention_backends_agree(head_dim: int) -> None:
    """A mixed batch (prefill chunks and decodes, in any order) through the kernels and through SDPA."""

    class Span:
        def __init__(self, start: int, num_new: int, table: list[int]) -> None:
            self.start, self.num_new, self.block_table = start, num_new, table

    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(2, 40, 4, 2, head_dim, generator=gen)
    spans = [Span(9, 1, [5, 2, 7]), Span(0, 6, [1, 3]), Span(3, 1, [0]), Span(20, 1, [8, 9, 10, 11, 12, 13])]
    spans += [Span(5, 6, [14, 15, 16])]
    md = AttentionMetadata.build(spans, 4, torch.device("cpu"), windows=(None, 3))
    q = torch.randn(sum(s.num_new for s in spans), 4, head_dim, generator=gen)
    chosen = choose_attention(torch.device("cpu"), torch.float32, head_dim)
    for window in (None, 3):
        fast = chosen.forward(q, k_cache, v_cache, md, 0.25, window)
        slow = SdpaAttention().forward(q, k_cache, v_cache, md, 0.25, window)
        torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64])  # SDPA's prefill, and the kernel's where it has one
@pytest.mark.parametrize("chosen", [True, False])  # the backend this machine gets, and SDPA
def test_fresh_prompts_read_in_place_equal_gathered(dtype: torch.dtype, head_dim: int, chosen: bool) -> None:
    """Fresh prompts given their keys as this step computed them (runs of equal length batched into
    one call; a decode row, a continued chunk and a prompt of another length in between) come out
    bitwise as with every prompt's keys gathered from the cache, on both windows."""

    class Span:
        def __init__(self, start: int, num_new: int, table: list[int]) -> None:
            self.start, self.num_new, self.block_table = start, num_new, table

    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, block_size = 6, 2, 4
    spans = [Span(0, 7, [1, 2]), Span(0, 7, [3, 4]), Span(5, 1, [5, 6]), Span(0, 7, [7, 8]), Span(0, 7, [9, 10])]
    spans += [Span(0, 5, [11, 12]), Span(0, 7, [13, 14]), Span(6, 3, [15, 16, 17]), Span(0, 7, [18, 19])]
    md = AttentionMetadata.build(spans, block_size, torch.device("cpu"), windows=(None, 3))
    n = sum(s.num_new for s in spans)
    k_cache, v_cache = torch.randn(2, 24, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim), v.view(n, kv_heads, head_dim)
    attention.write_kv(k_cache, v_cache, k, v, md)
    backend: AttentionBackend = choose_attention(torch.device("cpu"), dtype, head_dim) if chosen else SdpaAttention()
    for window in (None, 3):
        gathered = backend.forward(q, k_cache, v_cache, md, 0.25, window)
        in_place = backend.forward(q, k_cache, v_cache, md, 0.25, window, k, v)
        assert torch.equal(in_place, gathered)
    # (and the keys given are the ones read, for the fresh prompts without a window)
    doubled = backend.forward(q, k_cache, v_cache, md, 0.25, None, k * 2, v)
    assert not torch.equal(doubled, backend.forward(q, k_cache, v_cache, md, 0.25, None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_linear_matches_separate(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(48, 32, bias=True), nn.Linear(48, 16, bias=False), nn.Linear(48, 8, bias=True)]
    layers = [lin.to(dtype) for lin in layers]
    fused = fuse_linears(layers, dtype, torch.device("cpu"))
    assert isinstance(fused, Linear) and fused.out_features == 56
    assert fused.kernel == default_kernel(torch.device("cpu"), dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in (1, 3, 64, 200):  # the laid-out weight serves any number of rows
        x = torch.randn(rows, 48).to(dtype)
        want = torch.cat([lin(x) for lin in layers], dim=-1)
        torch.testing.assert_close(fused(x).float(), want.float(), atol=tol, rtol=tol)


def test_onednn_rows_are_few_sizes() -> None:
    """oneDNN compiles a kernel per shape, so its linears see a bounded set of row counts; padding
    stays under 8 rows at decode sizes and 64 past them."""
    sizes = [onednn_rows(r) for r in range(1, 2049)]
    assert all(max(r, MIN_ROWS) <= p <= r + (7 if r <= 256 else 63) for r, p in enumerate(sizes, 1))
    assert len(set(sizes)) <= 64


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_linear_padded_rows_match(dtype: torch.dtype) -> None:
    """Rows padded to oneDNN's sizes come back as the rows asked for, each the product of its input."""
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(40, 24, generator=gen).to(dtype), torch.randn(40, generator=gen).to(dtype)
    linear = Linear(w, b, "onednn")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in (1, 5, 33, 257):
        x = torch.randn(rows, 24, generator=gen).to(dtype)
        got = linear(x)
        assert got.shape == (rows, 40) and got.is_contiguous()
        torch.testing.assert_close(got.float(), F.linear(x.float(), w.float(), b.float()), atol=tol, rtol=tol)


@pytest.mark.skipif(
    not cpu_kernels.float_gemm_available(torch.device("cpu"), torch.float32), reason="no AVX-512: oneDNN runs"
)
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (45, 33), (7, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_float_gemm_within_float32_bound(out_features: int, in_features: int, bias: bool) -> None:
    """ppserve's float32 GEMM against a float64 product, at M = 1, 7, 32 and 300 (a 7-row tail of
    the 8-row passes, and a last group of fewer than 32 outputs). Each output is one sum of K
    products with float32 roundings, so its error is at most K * 2^-24 * sum |x_k w_k| (Higham's
    bound for a recursive sum, with room for the bias's add)."""
    gen = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    linear = Linear(w, b, "ppserve")
    for rows in (1, 7, 32, 300):
        x = torch.randn(rows, in_features, generator=gen)
        want = x.double() @ w.double().T + (0 if b is None else b.double())
        bound = (in_features + 1) * 2.0**-24 * (x.double().abs() @ w.double().abs().T + (0 if b is None else b.abs()))
        assert ((linear(x).double() - want).abs() <= bound).all()


@pytest.mark.skipif(
    not cpu_kernels.float_gemm_available(torch.device("cpu"), torch.bfloat16), reason="no AVX-512 BF16: oneDNN runs"
)
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (45, 34), (7, 2)])
@pytest.mark.parametrize("bias", [True, False])
def test_bfloat16_gemm_within_bound(out_features: int, in_features: int, bias: bool) -> None:
    """ppserve's bfloat16 GEMM against a float64 product of the same bfloat16 values, at M = 1, 7,
    32 and 300: the float32 sum's error (as float_gemm's, see above) plus the output's rounding to
    bfloat16 (half a unit in the last of its 8 bits)."""
    gen = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    linear = Linear(w, b, "ppserve")
    assert linear.gemm is not None
    for rows in (1, 7, 32, 300):
        x = torch.randn(rows, in_features, generator=gen).bfloat16()
        want = x.double() @ w.double().T + (0 if b is None else b.double())
        sums = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
        got = linear(x)
        assert got.dtype == torch.bfloat16
        assert ((got.double() - want).abs() <= (in_features + 1) * 2.0**-24 * sums + want.abs() * 2.0**-8).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_gemm_row_does_not_depend_on_batch(dtype: torch.dtype) -> None:
    """A row's output is bitwise the same alone, in any pass of 8 rows, and past a chunk of 256:
    a request's tokens come out the same in whatever micro-batch the pipeline puts them."""
    if not cpu_kernels.float_gemm_available(torch.device("cpu"), dtype):
        pytest.skip("no ppserve GEMM for this dtype here: oneDNN runs")
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(100, 64, generator=gen).to(dtype), torch.randn(100, generator=gen).to(dtype)
    linear = Linear(w, b, "ppserve")
    x = torch.randn(300, 64, generator=gen).to(dtype)
    whole = linear(x)
    for start, rows in [(0, 1), (5, 1), (3, 7), (250, 9), (299, 1), (100, 200)]:
        assert torch.equal(linear(x[start : start + rows]), whole[start : start + rows])


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "int4"])
def test_gemm_same_whichever_threads_take_its_groups(kind: str) -> None:
    """ppserve's GEMMs share a weight's groups out over the thread team, and a thread done with its
    own takes over what is left of the others' (`shared_for`, cpu_kernels.h). With 8 threads on
    two cores the OS stops threads in the middle of their groups, so that the others take them:
    every output is still bitwise equal to one thread's, at M = 1, 7, 32 and 200, over rounds.
    Before each call a block of NaN of the output's size is freed, which the output usually
    reuses, so that a group nobody computed shows (a thief that skips its groups fails this)."""
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(2000, 96, generator=gen)  # 63 float groups, 125 quantized ones
    if kind.startswith("int"):
        if not cpu_kernels.quant_gemm_available(torch.device("cpu"), dtype):
            pytest.skip("no AVX-512 VNNI here: torch's quantized kernels run")
        if kind == "int8":
            qw = quantize_int8(w)
        else:
            q = torch.randint(0, 16, (2000, 96), generator=gen, dtype=torch.uint8)
            qw = QuantWeight(4, q, torch.rand(2000, 96 // GROUP, generator=gen), torch.randn(2000, 96 // GROUP))
        linear: Linear | QuantLinear = QuantLinear(qw, None, dtype, torch.device("cpu"), "ppserve")
    else:
        if not cpu_kernels.float_gemm_available(torch.device("cpu"), dtype):
            pytest.skip("no ppserve GEMM for this dtype here: oneDNN runs")
        linear = Linear(w.to(dtype), None, "ppserve")
    xs = [torch.randn(rows, 96, generator=gen).to(dtype) for rows in (1, 7, 32, 200)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [linear(x) for x in xs]
        for threads in (2, 8):
            torch.set_num_threads(threads)
            for _ in range(20):
                for x, want in zip(xs, alone, strict=True):
                    torch.full_like(want, float("nan"))  # made and freed at once
                    assert torch.equal(linear(x), want)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(
    not cpu_kernels.float_gemm_available(torch.device("cpu"), torch.float32), reason="no AVX-512: oneDNN runs"
)
@pytest.mark.parametrize("bias", [True, False])
def test_gate_up_with_silu_equals_gemm_then_silu_mul(bias: bool) -> None:
    """An MLP's gate/up linear with the SiLU in its GEMM gives bitwise what the plain GEMM followed
    by silu_mul gives, at M = 1, 7, 32 and 200 and past a 256-row chunk; NaN and infinity included.
    A width that is not a multiple of 32 keeps the plain GEMM (the caller applies the SiLU)."""
    gen = torch.Generator().manual_seed(int(bias))
    dim, inp = 96, 72
    w = torch.randn(2 * dim, inp, generator=gen)
    b = torch.randn(2 * dim, generator=gen) * 4 if bias else None
    fused, plain = Linear(w, b, "ppserve", gated=True), Linear(w, b, "ppserve")
    assert fused.silu and not plain.silu
    for rows in (1, 7, 32, 200, 300):
        x = torch.randn(rows, inp, generator=gen) * 3
        x[0, :3] = torch.tensor([float("nan"), float("inf"), 0.0])
        got = fused(x)
        assert got.shape == (rows, dim)
        assert torch.equal(got.nan_to_num(7.0), cpu_kernels.silu_mul(plain(x)).nan_to_num(7.0))
    odd = Linear(torch.randn(2 * 40, inp, generator=gen), None, "ppserve", gated=True)
    assert not odd.silu and odd(x).shape == (300, 80)


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference in units of the last place of `want`'s dtype."""
    eps = torch.finfo(want.dtype).eps
    return float(((got.float() - want.float()).abs() / (want.float().abs() * eps).clamp_min(1e-30)).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_add_and_norm_kernel_matches_torch(dtype: torch.dtype, rows: int) -> None:
    """The residual add is the same IEEE add (bitwise); the norm differs only in the order of its
    sum of squares and in its rsqrt, a few float32 ulps, which bfloat16's rounding hides or turns
    into at most one bfloat16 ulp."""
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5).requires_grad_(False)
    norm.weight.data = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    h = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    add = torch.randn(rows, 576, generator=gen).to(dtype)
    h_torch, h_fast = h.clone(), h.clone()
    want = norm.add_and_norm(h_torch, add)
    norm.fast = True
    got = norm.add_and_norm(h_fast, add)
    assert torch.equal(h_fast, h_torch)
    assert got.dtype == dtype and _ulps(got, want) <= (8 if dtype == torch.float32 else 1.01)
    assert torch.equal(norm.add_and_norm(h_fast.clone(), None), got)  # without the add: the same norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu"])
def test_gated_mul_kernel_matches_torch(dtype: torch.dtype, gelu: bool) -> None:
    """SiLU's exp is the kernel's own polynomial, not torch's: a few float32 ulps apart (at most 4
    over [-87, 87]), at most one in bfloat16; the product is then rounded as torch rounds it. GELU's
    tanh approximation (Gemma) is x * sigmoid(2u) there, with the same exp: as close to the exact
    formula (where torch's 1 + tanh(u) cancels, far below zero, closer), and within float32
    rounding of torch's values. NaN and infinity as torch."""
    gate_up = (torch.randn(33, 2 * 1536, generator=torch.Generator().manual_seed(5)) * 4).to(dtype)
    gate_up[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    gate, up = gate_up.chunk(2, dim=-1)
    torch_act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    got = cpu_kernels.silu_mul(gate_up, gelu=gelu)
    assert got.dtype == dtype
    assert torch.equal(got[0, :3].nan_to_num(7.0), (torch_act * up)[0, :3].nan_to_num(7.0))
    x = gate[1:].double()
    # 0.5 x (1 + tanh(u)) = x sigmoid(2u): the sigmoid's form does not cancel, in float64 either
    two_u = 2 * (2 / math.pi) ** 0.5 * (x + 0.044715 * x**3)
    exact = x * torch.sigmoid(two_u) if gelu else F.silu(x)
    want = (exact.to(dtype).double() * up[1:].double()).to(dtype)
    # exp's argument is computed in float32 for GELU: its rounding, times the argument, is exp's
    # relative error
    slack = 1 + two_u.abs() if gelu and dtype == torch.float32 else torch.ones_like(x)
    eps = torch.finfo(dtype).eps
    ulps = (got[1:].double() - want.double()).abs() / (want.double().abs() * eps).clamp_min(1e-30)
    assert float((ulps / slack).max()) <= (8 if dtype == torch.float32 else 1.01)
    if gelu:
        torch.testing.assert_close(
            got[1:], (torch_act * up)[1:], rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_write_kv_kernel_equals_torch(dtype: torch.dtype, qk_norm: bool) -> None:
    """RoPE with each product and sum rounded as torch's ops round them, and no fused multiply-add:
    bitwise equal, in place on views of the fused qkv output (or on q/k-normed copies), with k and v
    at their cache slots."""
    gen = torch.Generator().manual_seed(7)
    n, heads, kv_heads, head_dim = 5, 9, 3, 64
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 17, 3, 250, 1024])
    inv_freq = rope_inv_freq(RopeConfig(theta=100000.0), head_dim)
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    sin[..., : head_dim // 2].neg_()
    slots = torch.tensor([11, 2, 30, 7, 19])
    caches = torch.zeros(2, 2, 8, 4, kv_heads, head_dim, dtype=dtype)  # [path, k/v, blocks, block, heads, dim]

    def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = x.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k, v = q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim), v.view(n, kv_heads, head_dim)
        return (q * 1.5, k * 0.5, v) if qk_norm else (q, k, v)  # copies, as q/k norms make

    q, k, v = split(qkv.clone())
    want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    caches[0, 0].view(-1, kv_heads, head_dim)[slots] = want_k
    caches[0, 1].view(-1, kv_heads, head_dim)[slots] = v
    q, k, v = split(qkv.clone())
    cpu_kernels.rope_write_kv(q, k, v, cos, sin, slots, caches[1, 0], caches[1, 1])
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(caches[0], caches[1])


def test_argmax_kernel_equals_torch() -> None:
    """Greedy sampling's argmax: the first index of the largest logit (ties), the first NaN's where
    a row has one, all -inf rows, the largest in the tail past the last 16 logits, and rows of a
    bigger tensor (strided)."""
    x = torch.randn(37, 49157, generator=torch.Generator().manual_seed(9))
    x[1] = float("-inf")
    x[2, 40000] = x[2, 100] = 1e9
    x[3, 9], x[3, 5000], x[3, 7] = float("inf"), float("nan"), float("nan")
    x[4, -1] = 1e9
    x[5] = 0.0
    x[6, 3] = float("inf")
    x[7, 40] = x[7, 41] = -0.0  # the rest below zero: -0.0 and 0.0 compare equal
    x[7] = torch.where(x[7] == 0, x[7], -x[7].abs() - 1)
    for t in (x, x[:, :49000], x[::2], x[:1, :7]):
        assert torch.equal(cpu_kernels.argmax(t), t.argmax(dim=-1))
