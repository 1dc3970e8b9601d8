"""A decode step's decoder layers in one call to the CPU kernel library (decode_step.cpp).

`StageModel.forward` runs its layers module by module. On a thin, deep model at small batches the
kernels of a layer take less time than the Python around them (SmolLM2 at batch 1: 30 layers,
some ten module calls and ctypes calls each). For a micro-batch of decode tokens only, this runs
the same kernels in the same order from C++, so the result is bitwise the same: a request's
tokens do not depend on which path their micro-batch took.

It applies where every layer runs on the library (float32, ppserve's own float or quantized GEMM
for each linear); `DecodeStep.build` says None otherwise, and the layers run as modules.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ppserve.engine.model import cpu_kernels
from ppserve.engine.model.attention import AttentionMetadata

if TYPE_CHECKING:  # model.py builds a DecodeStep
    from ppserve.engine.model.model import DecoderLayer

# A GEMM's `kind` in decode_step.cpp, by the kernel's name in cpu_kernels.PackedGemm.
_KINDS = {"float_gemm": 0, "quant_gemm_q4": 4, "quant_gemm_q8": 8}


class _Gemm(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int64),
        ("weight", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("mins", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("out_features", ctypes.c_int64),
        ("in_features", ctypes.c_int64),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("qkv", _Gemm),
        ("out", _Gemm),
        ("gate_up", _Gemm),
        ("down", _Gemm),
        ("window", ctypes.c_int64),
    ]


class _Dims(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


def _gemm(linear: torch.nn.Module) -> _Gemm | None:
    """A `Linear` or `QuantLinear` (engine/model/linear.py, quantized.py) as decode_step.cpp takes it,
    or None where it does not run one of the library's GEMMs."""
    packed = getattr(linear, "gemm", None)
    if not isinstance(packed, cpu_kernels.PackedGemm) or packed.kernel not in _KINDS:
        return None
    *weights, bias = packed.pointers  # (weight, bias) or (weight, scales, mins, bias)
    weight, scales, mins = (*weights, None, None)[:3]
    return _Gemm(_KINDS[packed.kernel], weight, scales, mins, bias, packed.out_features, linear.in_features)


class DecodeStep:
    """The layers of one stage, as the library's decode step runs them."""

    def __init__(self, layers: Sequence[_Layer], dims: _Dims, keep: Sequence[torch.Tensor]) -> None:
        fn = cpu_kernels.decode_layers()
        assert fn is not None
        self.fn = fn
        self.layers = (_Layer * len(layers))(*layers)
        self.dims = dims
        self.keep = keep  # the norms' weights, alive as long as their pointers are

    @classmethod
    def build(cls, layers: Sequence[DecoderLayer]) -> DecodeStep | None:
        """From a stage's fused layers, or None where some layer does not run entirely on the
        library (then the modules run)."""
        if not layers or cpu_kernels.decode_layers() is None:
            return None
        structs: list[_Layer] = []
        keep: list[torch.Tensor] = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            modules = (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm)
            norms = [None if n is None else n.weight.detach().contiguous() for n in modules]
            if not (attn.fast and mlp.fast) or any(n is not None and n.dtype != torch.float32 for n in norms):
                return None
            if any(n is not None and n.eps != layer.input_layernorm.eps for n in modules):
                return None  # the step takes one eps for every norm
            gemms = [_gemm(linear) for linear in (attn.qkv, attn.out, mlp.gate_up, mlp.down)]
            if None in gemms:
                return None
            keep += [n for n in norms if n is not None]
            pointers = [None if n is None else n.data_ptr() for n in norms]
            structs.append(_Layer(*pointers, *gemms, attn.window or 0))
        attn, norm = layers[0].self_attn, layers[0].input_layernorm
        dims = _Dims(norm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim, norm.eps, attn.scale)
        return cls(structs, dims, keep)

    @staticmethod
    def applies(md: AttentionMetadata, rows: int) -> bool:
        """Whether a micro-batch of `rows` rows is decode tokens only, in row order."""
        d = md.decode
        return not md.prefills and d is not None and d.rows == slice(0, rows)

    def __call__(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, md: AttentionMetadata
    ) -> None:
        """h: [n, hidden] float32, the residual stream, updated in place to the stage's output;
        cos, sin: [n, 1, head_dim] as StageModel.forward makes them; kv: the stage's whole cache,
        [layers, 2, blocks, block_size, kv_heads, head_dim]. Only where `applies`."""
        d = md.decode
        assert d is not None and all(t.is_contiguous() for t in (h, cos, sin, kv))
        tables, lens, slots = d.block_tables.contiguous(), d.context_lens.contiguous(), md.slot_mapping.contiguous()
        self.fn(
            ctypes.byref(self.layers), len(self.layers), ctypes.byref(self.dims), h.data_ptr(), kv.data_ptr(),
            kv.shape[2] * kv.shape[3], cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(),
            lens.data_ptr(), h.shape[0], tables.shape[1], d.block_size,
        )  # fmt: skip
