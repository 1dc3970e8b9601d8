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
from ppserve.engine.model.gguf_checkpoint import prepare_gguf, read_gguf_quantized, read_gguf_tensors
from ppserve.engine.model.model import DecoderLayer
from ppserve.engine.model.model_config import ConfigError
from ppserve.engine.model.quantized import GROUP, QuantLinear, QuantWeight, from_gguf_blocks, quantize_int8
from ppserve.engine.model.tiny_checkpoint import TinySpec, make_tiny_checkpoint
from ppserve.scheduler.sampling_params import SamplingParams

# Every matrix's rows whole 32-value blocks; q/k permuted by llama.cpp; 72 output rows for k/v,
# not a multiple of the int4 packer's 16 (padded).
SPEC = TinySpec(arch="llama", seed=21, hidden_size=96, intermediate_size=160, num_layers=4, num_heads=4, num_kv_heads=2)
ROWS = (1, 7, 32, 200)
# bfloat16 keeps 8 significant bits: rounding a value costs at most 2^-9 of it.
BF16_UNIT = 2.0**-9


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
    if w.bits == 8:
        return w.q.float().abs() * w.scales.abs()
    assert w.zeros is not None
    out, inp = w.shape
    parts = (w.q.float() - 8).abs().view(out, -1, GROUP) * w.scales.abs()[..., None] + w.zeros.abs()[..., None]
    return parts.view(out, inp)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_dequantize_then_matmul(bits: int, rows: int, dtype: torch.dtype) -> None:
    """Within the rounding the kernels do: the input, the scales and zeros, and the output each
    rounded once to bfloat16 (2^-9 relative each). So |error| <= 2^-9 * (2 * |x| @ |W|.T + |y|),
    with |W| the bound above and the float32 accumulation's error far below (K = 160 terms):
    the test allows twice that."""
    out, inp = 72, 160
    w = quantize_int8(torch.randn(out, inp) * 0.05) if bits == 8 else _int4(out, inp, seed=rows)
    bias = torch.randn(out).to(dtype)
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows)).to(dtype)
    y = QuantLinear(w, bias, dtype, torch.device("cpu"))(x)
    assert y.dtype == dtype and y.shape == (rows, out)
    xf = x.float()
    reference = xf @ w.dequantize().T
    bound = BF16_UNIT * (2 * xf.abs() @ _magnitude(w).T + reference.abs())
    err = (y.float() - bias.float() - reference).abs()
    assert (err <= 2 * bound + 1e-6).all(), (err / bound).max()
    # the kernel really reads integers: its error is not zero, nor larger than the bound allows
    assert err.max() > 0


def test_int8_is_half_a_step_of_each_row() -> None:
    w = torch.randn(64, 96) * torch.logspace(-3, 0, 64)[:, None]
    qw = quantize_int8(w)
    assert qw.q.dtype == torch.int8 and qw.q.abs().max() <= 127
    assert ((qw.dequantize() - w).abs() <= qw.scales / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_gguf_blocks_kept_as_they_are(qtype: Q) -> None:
    """Q4_0/Q4_1 read into int4 dequantize to gguf-py's values (up to float32 rounding of
    (q - 8) * d + (m + 8d) against q * d + m); Q8_0 into int8 within half of its row step."""
    values = np.random.default_rng(qtype.value).standard_normal((48, 128)).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32)).reshape(48, 128)
    w = from_gguf_blocks(qtype.name, raw, (48, 128))
    got = w.dequantize()
    if qtype == Q.Q8_0:
        assert w.bits == 8 and ((got - expected).abs() <= w.scales / 2 * (1 + 1e-6)).all()
    else:
        assert w.bits == 4 and w.q.max() <= 15
        assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("hf") / "llama", SPEC)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_0, Q.Q8_0], ids=lambda q: q.name)
def test_gguf_kept_quantized_runs_equal_across_pp(llama_dir: Path, tmp_path: Path, qtype: Q) -> None:
    """With --quantization auto every linear keeps the file's type (q/k unpermuted row by row), the
    logits stay close to the dequantized model's, and greedy tokens are the same at PP 1, 2 and 3."""
    path = write_gguf(llama_dir, tmp_path / "m.gguf", qtype)
    prepared = prepare_gguf(path)
    reader = gguf.GGUFReader(path)
    q_proj = next(t for t in reader.tensors if t.name == "blk.1.attn_q.weight")
    kept = dict(read_gguf_quantized(prepared, ["model.layers.1.self_attn.q_proj.weight"]))
    floats = EngineConfig.create(path, quantization="none")
    ((_, dequantized),) = read_gguf_tensors(floats.model, ["model.layers.1.self_attn.q_proj.weight"], torch.float32)
    w = kept["model.layers.1.self_attn.q_proj.weight"]
    assert q_proj.tensor_type == qtype and w.bits == (8 if qtype == Q.Q8_0 else 4)
    tol = w.scales.max().item() / 2 if qtype == Q.Q8_0 else 1e-5
    assert (w.dequantize() - dequantized).abs().max().item() <= tol

    prompts = [random_prompt(random.Random(i), 12 + 5 * i) for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = []
    for pp in (1, 2, 3):
        pipe = pipeline(path, pp_size=pp, quantization="auto")
        layer = pipe.executor.runners[0].model.model.layers["0"]
        assert isinstance(layer, DecoderLayer) and isinstance(layer.mlp.gate_up, QuantLinear)
        runs.append([g.token_ids for g in pipe.generate(prompts, params)])
        pipe.close()
    assert runs[0] == runs[1] == runs[2]


def test_int8_on_a_float_checkpoint(llama_dir: Path) -> None:
    """--quantization int8 quantizes every linear of a safetensors checkpoint, head included;
    greedy tokens equal at PP 1 and 2."""
    prompts = [random_prompt(random.Random(i), 10 + i) for i in range(3)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    runs = []
    for pp in (1, 2):
        pipe = pipeline(llama_dir, pp_size=pp, quantization="int8")
        last = pipe.executor.runners[-1].model
        assert isinstance(last.head, QuantLinear) and last.head.bits == 8
        runs.append([g.token_ids for g in pipe.generate(prompts, params)])
        pipe.close()
    assert runs[0] == runs[1]


def test_unknown_quantization_is_refused(llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match="quantization must be one of auto, none, int8; got 'int3'"):
        EngineConfig.create(llama_dir, quantization="int3")
