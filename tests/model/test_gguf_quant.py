"""GGUF tensors run as their blocks (engine/model/gguf_quant.py, gguf_gemm.cpp): every kept type
against its dequantized weights with the activations rounded as llama.cpp rounds them, embeddings
exact, and a K-quant model kept quantized, equal across pipeline sizes, at the file's size."""

from __future__ import annotations

import gc
import random
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_files import write_gguf
from helpers import pipeline, prompt_logits, random_prompt

from ppserve.engine.model.gguf_checkpoint import prepare_gguf, read_gguf_quantized, read_gguf_tensors
from ppserve.engine.model.gguf_quant import (
    BLOCKS,
    GGUFEmbedding,
    GGUFLinear,
    GGUFWeight,
    from_blocks,
    gguf_kernels_available,
    random_blocks,
)
from ppserve.engine.model.model import DecoderLayer
from ppserve.engine.model.tiny_checkpoint import TinySpec, make_tiny_checkpoint
from ppserve.scheduler.sampling_params import SamplingParams

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    not gguf_kernels_available(CPU, torch.float32), reason="no C++ compiler: GGUF tensors are dequantized"
)
# Every matrix's rows whole 256-value blocks; q/k permuted by llama.cpp; tied embeddings.
SPEC = TinySpec(arch="llama", seed=31, hidden_size=256, intermediate_size=512, num_layers=3, tie_word_embeddings=True)
# What llama.cpp's Q4_K_M and Q5_K_M files are made of.
Q4_K_M = {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "token_embd": Q.Q6_K, "attn_output": Q.Q5_0, "ffn_up": Q.Q8_0}
Q5_K_M = {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "token_embd": Q.Q8_0, "ffn_gate": Q.Q5_1, "ffn_up": Q.Q4_1}


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPSERVE_CACHE_DIR", str(tmp_path / "cache"))


def _weight(type_name: str, shape: tuple[int, int], seed: int) -> tuple[GGUFWeight, torch.Tensor]:
    raw = random_blocks(type_name, shape, np.random.default_rng(seed))
    values = gguf.quants.dequantize(raw, Q[type_name]).astype(np.float32)
    return from_blocks(type_name, raw, shape), torch.from_numpy(values).reshape(shape)


def _int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernel rounds it (llama.cpp's Q8 activations): int8 per block of 32, scale
    max |x| / 127, in float32 as the kernel computes them; returned in float64 (exact)."""
    blocks = x.float().view(x.shape[0], -1, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.round(blocks * torch.where(scale > 0, 1 / scale, 0))
    return (q.double() * scale.double()).view(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("type_name", list(BLOCKS))
def test_each_type_equals_its_dequantized_weights(type_name: str, dtype: torch.dtype) -> None:
    """A linear of two parts (this type and Q6_K, as a fused q/k/v mixes them) with a bias equals the
    dequantized weights times the int8-rounded activations, to float32 summation (bfloat16: its
    rounding of the inputs and the output); each row's result is the same alone as in a batch."""
    w, ref_w = _weight(type_name, (80, 512), seed=1)
    v, ref_v = _weight("Q6_K", (45, 512), seed=2)  # ends in the middle of a packed group of 8 rows
    bias = torch.randn(125)
    linear = GGUFLinear([w, v], bias, dtype)
    x = torch.randn(37, 512).to(dtype)
    y = linear(x)
    xq, ref = _int8_activations(x.float()), torch.cat([ref_w, ref_v]).double()
    expected = xq @ ref.T + bias.to(dtype).double()
    magnitude = xq.abs() @ ref.abs().T + bias.abs().double()  # what rounding errors scale with
    unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-20
    assert y.shape == (37, 125) and y.dtype == dtype
    assert ((y.double() - expected).abs() <= unit * magnitude).all()
    for i in (0, 5, 36):  # the same row alone: bitwise what it was in the batch
        assert torch.equal(linear(x[i : i + 1]), y[i : i + 1])


@pytest.mark.parametrize("type_name", list(BLOCKS))
def test_embedding_rows_are_gguf_py_dequantization(type_name: str) -> None:
    w, ref = _weight(type_name, (300, 256), seed=3)
    ids = torch.tensor([0, 299, 7, 7, 123])
    assert torch.allclose(GGUFEmbedding(w, torch.float32)(ids), ref[ids], rtol=2**-22, atol=0)
    assert torch.equal(GGUFEmbedding(w, torch.bfloat16)(ids), ref[ids].to(torch.bfloat16))
    with pytest.raises(IndexError):
        GGUFEmbedding(w, torch.float32)(torch.tensor([300]))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("hf") / "llama", SPEC)


@pytest.mark.parametrize("mix", [Q4_K_M, Q5_K_M], ids=["Q4_K_M", "Q5_K_M"])
def test_k_quant_model_runs_kept_quantized(llama_dir: Path, tmp_path: Path, mix: dict[str, Q]) -> None:
    """A Q4_K_M- or Q5_K_M-style file keeps every matrix (tied embedding and head included) as its
    blocks, repacked at load (the mapped file then let go); its weights hold about the file's tensor
    bytes; logits are close to the dequantized model's; greedy tokens equal at PP 1, 2 and 3."""
    path = write_gguf(llama_dir, tmp_path / "m.gguf", Q.Q4_K, mix=mix)
    prepared = prepare_gguf(path)
    name = "model.layers.1.self_attn.q_proj.weight"
    ((_, kept),) = read_gguf_quantized(prepared, [name])
    ((_, dequantized),) = read_gguf_tensors(prepare_gguf(path), [name], torch.float32)
    assert torch.equal(kept.dequantize(), dequantized)

    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    prompts = [random_prompt(random.Random(i), 12 + 9 * i) for i in range(3)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    runs: list[list[list[int]]] = []
    logits = torch.empty(0)
    for pp in (1, 2, 3):
        pipe = pipeline(path, pp_size=pp, quantization="auto")
        models = [runner.model for runner in pipe.executor.runners]
        first, last = models[0], models[-1]
        assert isinstance(first.model.embed_tokens, GGUFEmbedding) and isinstance(last.head, GGUFLinear)
        assert last.head.parts[0] is first.model.embed_tokens.table or pp > 1  # tied: one tensor
        for model in models:
            for layer in model.model.layers.values():
                assert isinstance(layer, DecoderLayer)
                for linear in (layer.self_attn.qkv, layer.self_attn.out, layer.mlp.gate_up, layer.mlp.down):
                    assert isinstance(linear, GGUFLinear)
        if pp == 1:  # one stage holds the whole model (stages of one process map the file apart)
            held = _weight_bytes(models)
            assert file_bytes <= held <= 1.1 * file_bytes, (held, file_bytes)
            gc.collect()  # the weights repacked, nothing holds the mapped file's pages
            assert str(path.resolve()) not in Path("/proc/self/maps").read_text()
            logits = prompt_logits(pipe, prompts[2])
        runs.append([g.token_ids for g in pipe.generate(prompts, params)])
        pipe.close()
    assert runs[0] == runs[1] == runs[2]
    floats = prompt_logits(pipeline(path, quantization="none"), prompts[2])
    # int8 activations cost each GEMM a fraction of a percent (the kernel test above bounds it
    # exactly); through the layers of a random model that grows to a few percent of the spread
    error = float((logits - floats).norm() / (floats - floats.mean(dim=-1, keepdim=True)).norm())
    print(f"relative error of the kept-quantized logits: {error:.4f}")
    assert error <= 0.1


def _weight_bytes(models: Sequence[torch.nn.Module]) -> int:
    """Bytes of every tensor the stages hold (their GGUF blocks, norms, biases), each storage once."""
    seen: dict[int, int] = {}
    for model in models:
        for module in model.modules():
            tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            tensors += [p.data for p in getattr(module, "parts", ())]
            if isinstance(module, GGUFEmbedding):
                tensors.append(module.table.data)
            for t in tensors:
                if t is not None and t.device.type != "meta":
                    seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())
