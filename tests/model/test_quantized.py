"""Weight-only quantized linears (engine/model/quantized.py): the kernels against a plain
dequantize-then-matmul reference, GGUF blocks read as they are, and greedy tokens equal across
pipeline sizes with the weights kept quantized."""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_files import write_gguf
from helpers import pipeline, random_prompt

from ppserve.engine.config import EngineConfig
from ppserve.engine.model import cpu_kernels
from ppserve.engine.model.gguf_checkpoint import prepare_gguf, read_gguf_quantized, read_gguf_tensors
from ppserve.engine.model.gguf_quant import GGUFLinear, gguf_kernels_available
from ppserve.engine.model.model import DecoderLayer
from ppserve.engine.model.model_config import ConfigError
from ppserve.engine.model.quantized import GROUP, QuantLinear, QuantWeight, from_gguf_blocks, quantize_int8
from ppserve.engine.model.tiny_checkpoint import TinySpec, make_tiny_checkpoint
from ppserve.scheduler.sampling_params import SamplingParams

# Every matrix's rows whole 32-value blocks; q/k permuted by llama.cpp; 72 output rows for k/v,
# not a multiple of the int4 packer's 16 (padded).
SPEC = TinySpec(arch="llama", seed=21, hidden_size=96, intermediate_size=160, num_layers=4, num_heads=4, num_kv_heads=2)
ROWS = (1, 7, 32, 200)
# bfloat16 keeps 8 significant bits: rounding a value costs at most 2^-8 of it (float16: 11 bits).
BF16_UNIT = 2.0**-8
FP16_UNIT = 2.0**-11


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPSERVE_CACHE_DIR", str(tmp_path / "cache"))


def _int4(out: int, inp: int, seed: int) -> QuantWeight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out, inp), generator=g, dtype=torch.uint8)
    scales = torch.rand(out, inp // GROUP, generator=g) * 0.05 + 1e-3
    zeros = torch.randn(out, inp // GROUP, generator=g) * 0.05
    return QuantWeight(4, q, scales, zeros)


def _magnitude(w: QuantWeight) -> torch.Tensor:
    """A bound on |w| built from the parts each kernel rounds: |q - 8| * |scale| + |zero| (int4),
    |q| * |scale| (int8)."""
    out, inp = w.shape
    if w.bits == 8:
        groups = w.scales.shape[1]
        return (w.q.float().abs().view(out, groups, -1) * w.scales.abs()[..., None]).view(out, inp)
    assert w.zeros is not None
    parts = (w.q.float() - 8).abs().view(out, -1, GROUP) * w.scales.abs()[..., None] + w.zeros.abs()[..., None]
    return parts.view(out, inp)


def _torch_bound(x: torch.Tensor, w: QuantWeight, y: torch.Tensor) -> torch.Tensor:
    """torch's kernels round the input, the scales and zeros, and the output each once to bfloat16
    (2^-8 relative each): |error| <= 2^-8 * (2 * |x| @ |W|.T + |y|), |W| as `_magnitude` bounds it."""
    return BF16_UNIT * (2 * x.abs() @ _magnitude(w).T + y.abs())


def _ppserve_bound(x: torch.Tensor, w: QuantWeight, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ppserve's kernel multiplies the weights with inputs rounded to int8 steps of max|x| / 127 per
    block of 32: each input off by at most half its block's step, times |w|. The scales and zeros are
    stored as float16 (2^-11 relative), and a bfloat16 output is rounded once (2^-8)."""
    rows, inp = x.shape
    half_steps = x.abs().view(rows, inp // GROUP, GROUP).amax(dim=-1) / 254  # [rows, blocks]
    w_sums = _magnitude(w).view(w.shape[0], inp // GROUP, GROUP).sum(dim=-1)  # [out, blocks]
    out_rounding = BF16_UNIT * y.abs() if dtype == torch.bfloat16 else 0
    return half_steps @ w_sums.T + FP16_UNIT * 2 * x.abs() @ _magnitude(w).T + out_rounding


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["ppserve", "torch"])
def test_kernel_equals_dequantize_then_matmul(bits: int, rows: int, dtype: torch.dtype, kernel: str) -> None:
    """Each kernel within the rounding it does (the bounds above; float32 accumulation's error is
    far below them at K = 160 terms): the test allows twice the bound."""
    if kernel == "ppserve" and not cpu_kernels.quant_gemm_available(torch.device("cpu"), dtype):
        pytest.skip("this CPU has no AVX-512 VNNI (or no compiler): torch's kernels run")
    out, inp = 72, 160
    # torch's int8 kernel scales whole rows: a weight of row scales, so that nothing is requantized
    w = (
        quantize_int8(torch.randn(out, inp) * 0.05, group=inp if kernel == "torch" else GROUP)
        if bits == 8
        else _int4(out, inp, seed=rows)
    )
    bias = torch.randn(out).to(dtype)
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows)).to(dtype)
    linear = QuantLinear(w, bias, dtype, torch.device("cpu"), kernel)
    assert linear.kernel == kernel
    y = linear(x)
    assert y.dtype == dtype and y.shape == (rows, out)
    xf = x.float()
    reference = xf @ w.dequantize().T
    bound = _torch_bound(xf, w, reference) if kernel == "torch" else _ppserve_bound(xf, w, reference, dtype)
    err = (y.float() - bias.float() - reference).abs()
    assert (err <= 2 * bound + 1e-6).all(), (err / bound).max()
    # the kernel really reads integers: its error is not zero, nor larger than the bound allows
    assert err.max() > 0


@pytest.mark.parametrize("bits", [8, 4])
def test_ppserve_kernel_keeps_nan_and_infinity(bits: int) -> None:
    """An input that is NaN or infinite cannot be rounded to int8: its row's outputs are NaN (the
    float product's would be NaN or infinite), and the other rows are unaffected; a row of subnormal
    inputs gives about zero."""
    if not cpu_kernels.quant_gemm_available(torch.device("cpu"), torch.float32):
        pytest.skip("this CPU has no AVX-512 VNNI (or no compiler): torch's kernels run")
    w = quantize_int8(torch.randn(40, 96) * 0.05) if bits == 8 else _int4(40, 96, seed=3)
    linear = QuantLinear(w, None, torch.float32, torch.device("cpu"), "ppserve")
    x = torch.randn(4, 96)
    x[0, 5], x[2, 70] = float("nan"), float("inf")
    x[3] = 1e-40  # subnormal: no overflow on the way to int8, and a product of about zero
    y = linear(x)
    assert y[0].isnan().all() and y[2].isnan().all() and y[1].isfinite().all()
    assert y[3].abs().max() <= 1e-30


def test_ppserve_kernel_takes_row_scales() -> None:
    """An int8 weight with one scale per row runs in ppserve's kernel as that scale for each block."""
    if not cpu_kernels.quant_gemm_available(torch.device("cpu"), torch.float32):
        pytest.skip("this CPU has no AVX-512 VNNI (or no compiler): torch's kernels run")
    rows = quantize_int8(torch.randn(24, 64) * 0.05, group=64)
    blocks = QuantWeight(8, rows.q, rows.scales.expand(24, 2).contiguous())
    x = torch.randn(5, 64)
    per_row = QuantLinear(rows, None, torch.float32, torch.device("cpu"), "ppserve")(x)
    assert torch.equal(per_row, QuantLinear(blocks, None, torch.float32, torch.device("cpu"), "ppserve")(x))


def test_int8_is_half_a_step_of_each_block() -> None:
    w = torch.randn(64, 96) * torch.logspace(-3, 0, 64)[:, None]
    qw = quantize_int8(w)
    assert qw.q.dtype == torch.int8 and qw.q.abs().max() <= 127 and qw.scales.shape == (64, 3)
    assert torch.equal(qw.scales.half().float(), qw.scales)  # stored as float16 without rounding
    steps = qw.scales.repeat_interleave(GROUP, dim=1)
    assert ((qw.dequantize() - w).abs() <= steps / 2 * (1 + 1e-3)).all()


def test_torch_kernel_requantizes_blocks_to_rows() -> None:
    """torch's int8 kernel has one scale per row: a block-scaled weight (Q8_0) is requantized, each
    weight within half a row step, then held with the row scale in bfloat16 (up to 127 * 2^-8 of a
    step more) and read through a bfloat16 output (2^-8 of the value)."""
    w = quantize_int8(torch.randn(48, 128) * 0.05)
    linear = QuantLinear(w, None, torch.float32, torch.device("cpu"), "torch")
    assert linear.kernel == "torch" and linear.scales is not None and linear.scales.shape == (48,)
    held = linear(torch.eye(128)).T  # row i of x = e_i reads column i of the weight as held
    exact = w.dequantize()
    row_steps = exact.abs().amax(dim=1, keepdim=True) / 127
    bound = row_steps * (0.5 + 127 * BF16_UNIT) + BF16_UNIT * held.abs()
    err = (held - exact).abs()
    assert (err <= bound * (1 + 1e-3)).all() and err.max() > 0


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_gguf_blocks_kept_as_they_are(qtype: Q) -> None:
    """Read as they are: Q8_0 into int8 blocks and Q4_0/Q4_1 into int4 dequantize to gguf-py's values
    (up to float32 rounding of (q - 8) * d + (m + 8d) against q * d + m)."""
    values = np.random.default_rng(qtype.value).standard_normal((48, 128)).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32)).reshape(48, 128)
    w = from_gguf_blocks(qtype.name, raw, (48, 128))
    got = w.dequantize()
    if qtype == Q.Q8_0:
        assert w.bits == 8 and torch.equal(got, expected)
    else:
        assert w.bits == 4 and w.q.max() <= 15
        assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("hf") / "llama", SPEC)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_0, Q.Q8_0], ids=lambda q: q.name)
def test_gguf_kept_quantized_runs_equal_across_pp(llama_dir: Path, tmp_path: Path, qtype: Q) -> None:
    """With --quantization auto every linear keeps the file's type (q/k unpermuted row by row): as
    QuantLinear's integers where ppserve's AVX-512 VNNI kernel runs, else as GGUF blocks
    (tests/model/test_gguf_quant.py); greedy tokens are the same at PP 1, 2 and 3."""
    path = write_gguf(llama_dir, tmp_path / "m.gguf", qtype)
    prepared = prepare_gguf(path)
    reader = gguf.GGUFReader(path)
    q_proj = next(t for t in reader.tensors if t.name == "blk.1.attn_q.weight")
    kept = dict(read_gguf_quantized(prepared, ["model.layers.1.self_attn.q_proj.weight"]))
    floats = EngineConfig.create(path, quantization="none")
    ((_, dequantized),) = read_gguf_tensors(floats.model, ["model.layers.1.self_attn.q_proj.weight"], torch.float32)
    w = kept["model.layers.1.self_attn.q_proj.weight"]
    assert q_proj.tensor_type == qtype and w.type_name == qtype.name
    assert (w.dequantize() - dequantized).abs().max().item() <= 1e-5
    packed = from_gguf_blocks(w.type_name, w.raw.numpy(), w.shape)
    assert packed.bits == (8 if qtype == Q.Q8_0 else 4) and (packed.dequantize() - dequantized).abs().max() <= 1e-5
    kind = QuantLinear if cpu_kernels.quant_gemm_available(torch.device("cpu"), torch.float32) else GGUFLinear

    prompts = [random_prompt(random.Random(i), 12 + 5 * i) for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = []
    for pp in (1, 2, 3):
        pipe = pipeline(path, pp_size=pp, quantization="auto")
        layer = pipe.executor.runners[0].model.model.layers["0"]
        assert isinstance(layer, DecoderLayer) and isinstance(layer.mlp.gate_up, kind)
        runs.append([g.token_ids for g in pipe.generate(prompts, params)])
        pipe.close()
    assert runs[0] == runs[1] == runs[2]


def test_int8_on_a_float_checkpoint(llama_dir: Path) -> None:
    """--quantization int8 quantizes every linear of a safetensors checkpoint, head included: as
    QuantLinear's int8 where ppserve's VNNI kernel runs, as GGUF's Q8_0 blocks elsewhere where the
    blocks' kernel does (AVX2, or plain C++); greedy tokens equal at PP 1 and 2."""
    prompts = [random_prompt(random.Random(i), 10 + i) for i in range(3)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    runs = []
    for pp in (1, 2):
        pipe = pipeline(llama_dir, pp_size=pp, quantization="int8")
        last = pipe.executor.runners[-1].model
        head = last.head
        cpu = torch.device("cpu")
        if not cpu_kernels.quant_gemm_available(cpu, torch.float32) and gguf_kernels_available(cpu, torch.float32):
            assert isinstance(head, GGUFLinear) and [p.type_name for p in head.parts] == ["Q8_0"]
        else:
            assert isinstance(head, QuantLinear) and head.bits == 8
        runs.append([g.token_ids for g in pipe.generate(prompts, params)])
        pipe.close()
    assert runs[0] == runs[1]


def test_unknown_quantization_is_refused(llama_dir: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"quantization \(--quantization\) must be one of auto, none, int8; got 'int3'"
    ):
        EngineConfig.create(llama_dir, quantization="int3")
