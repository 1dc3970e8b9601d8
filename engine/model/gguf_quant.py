"""GGUF's quantized tensors kept quantized: linears and embeddings over their blocks, repacked.

The K-quant files people download (Q4_K_M, Q5_K_M) are mostly Q4_K, Q5_K and Q6_K tensors with
some Q8_0 and Q5_0. Each GGML type packs a row of weights in blocks of 32 or 256 values with their
own scales; dequantized to float32 a 4.5-bit file takes seven times its size. Here a tensor is read
as a view of the memory-mapped file (`GGUFWeight`) and repacked once, at load, into its kernel's
layout (`PackedWeight`: eight rows side by side, the same bytes but for K-quants' 6-bit scales taken
apart, Q4_K 148 a block for 144); the file's pages are then no longer needed. engine/model/gguf_gemm.cpp
runs it: the activations rounded to int8 in blocks of 32 (as llama.cpp computes its quantized dot
products) and multiplied with the weights' integers.

- `GGUFLinear`: y = x @ W.T + b for W one or more tensors stacked along the output (a fused q/k/v
  whose v is Q6_K and q, k Q4_K stays three tensors of their own types; x is rounded once).
- `GGUFEmbedding`: an embedding lookup, the looked-up rows dequantized; a tied embedding that is
  also the LM head is one packed tensor, used by both.

Where the kernel library is not built (no compiler, another device), the caller dequantizes
instead (`gguf_kernels_available`). IQ types and other GGML types are always dequantized.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ppserve.engine.model import cpu_kernels, huge_pages

# GGML type -> (values per block, bytes per block), in gguf_gemm.cpp's enum order.
BLOCKS: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
_TYPE_IDS = {name: i for i, name in enumerate(BLOCKS)}
# A row's bytes per block once packed (gguf_gemm.cpp's packed_block / 8): the file's, but for the
# K-quants, whose 6-bit scales and mins are taken apart into bytes.
_PACKED_BLOCK = {**{name: nbytes for name, (_, nbytes) in BLOCKS.items()}, "Q4_K": 148, "Q5_K": 180}
LANES = 8  # rows a packed group holds
_PTR, _INT64 = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True)
class GGUFWeight:
    """A [out, in] weight as its GGUF blocks: `raw` uint8 [out, row bytes], row i's blocks in order."""

    type_name: str  # a key of BLOCKS
    raw: torch.Tensor
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        values, nbytes = BLOCKS[self.type_name]
        out, inp = self.shape
        assert inp % values == 0 and tuple(self.raw.shape) == (out, inp // values * nbytes), "rows of whole blocks"
        assert self.raw.dtype == torch.uint8 and self.raw.is_contiguous()

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (gguf-py's reference dequantization, as `--quantization none` reads it)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(self.raw.numpy(), GGMLQuantizationType[self.type_name])
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(self.shape)

    def rows(self, index: torch.Tensor) -> GGUFWeight:
        """The weight with its output rows reordered (llama.cpp's q/k permutation undone): a copy."""
        return GGUFWeight(self.type_name, self.raw[index].contiguous(), self.shape)

    @functools.cached_property
    def packed(self) -> PackedWeight:
        """The weight in the kernels' layout (made once: the LM head and the embedding it is tied to
        share it)."""
        fns = _kernels()
        assert fns is not None, "only where gguf_kernels_available()"
        type_id, (out, inp) = _TYPE_IDS[self.type_name], self.shape
        nbytes = fns["packed_bytes"](type_id, out, inp)
        assert nbytes == packed_nbytes(self.type_name, self.shape)
        data = huge_pages.empty(nbytes)  # (the kernels stream it at every step: 2 MB pages)
        fns["pack"](type_id, self.raw.data_ptr(), out, inp, data.data_ptr())
        return PackedWeight(self.type_name, data, self.shape)


@dataclass(frozen=True)
class PackedWeight:
    """A GGUFWeight [out, in] as gguf_gemm.cpp's kernels read it: `data` uint8, groups of 8 rows."""

    type_name: str
    data: torch.Tensor
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def packed_nbytes(type_name: str, shape: Sequence[int]) -> int:
    """The bytes of a [out, in] weight of `type_name` once packed (its rows rounded up to groups of 8)."""
    out, inp = int(shape[0]), int(shape[1])
    return -(-out // LANES) * LANES * (inp // BLOCKS[type_name][0]) * _PACKED_BLOCK[type_name]


def from_blocks(type_name: str, raw: np.ndarray, shape: Sequence[int]) -> GGUFWeight:
    """A tensor's bytes (uint8, e.g. a slice of the mapped file) as a GGUFWeight, without a copy."""
    out, inp = int(shape[0]), int(shape[1])
    values, nbytes = BLOCKS[type_name]
    return GGUFWeight(type_name, torch.from_numpy(raw.reshape(out, inp // values * nbytes)), (out, inp))


def gguf_kernels_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether GGUFLinear and GGUFEmbedding run here (the kernel library, on the CPU)."""
    return cpu_kernels.available(device, dtype) and _kernels() is not None


@functools.cache
def _kernels() -> dict[str, Any] | None:
    dll = cpu_kernels.load()
    if dll is None or not hasattr(dll, "gguf_linear_f32"):
        return None
    fns: dict[str, Any] = {}
    for suffix in cpu_kernels.KERNEL_DTYPES.values():
        linear, rows = getattr(dll, f"gguf_linear_{suffix}"), getattr(dll, f"gguf_rows_{suffix}")
        linear.argtypes, linear.restype = [_PTR, _INT64, _INT64, _INT64] + [_PTR] * 5, None
        rows.argtypes, rows.restype = [_INT64, _PTR, _INT64, _PTR, _INT64, _PTR], None
        moe = getattr(dll, f"gguf_moe_{suffix}")
        moe.argtypes, moe.restype = [_PTR, _INT64, _INT64, _PTR, _PTR] + [_INT64] * 3 + [_PTR] * 4, None
        fns[f"linear_{suffix}"], fns[f"rows_{suffix}"], fns[f"moe_{suffix}"] = linear, rows, moe
    fns["packed_bytes"], fns["pack"] = dll.gguf_packed_bytes, dll.gguf_pack
    fns["packed_bytes"].argtypes, fns["packed_bytes"].restype = [_INT64] * 3, _INT64
    fns["pack"].argtypes, fns["pack"].restype = [_INT64, _PTR, _INT64, _INT64, _PTR], None
    return fns


def _kernel(name: str, dtype: torch.dtype) -> Any:
    fns = _kernels()
    assert fns is not None, "only where gguf_kernels_available()"
    return fns[f"{name}_{cpu_kernels.KERNEL_DTYPES[dtype]}"]


class GGUFLinear(nn.Module):
    """y = x @ W.T + b, W the `parts` stacked along the output; x: [rows, in] -> [rows, out] in `dtype`."""

    def __init__(self, parts: Sequence[GGUFWeight], bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        assert len({p.shape[1] for p in parts}) == 1, "parts read the same input"
        assert 1 <= len(parts) <= 8, "the kernel takes up to 8 parts"
        self.parts = [p.packed for p in parts]  # (the file's pages are not kept)
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        self.dtype = dtype
        self.bias: torch.Tensor | None
        self.register_buffer("bias", None if bias is None else bias.to(dtype).contiguous(), persistent=False)
        # The kernel's arguments, made once (the C++ decode step reads them too): a step calls this
        # some hundred times.
        self.types = (ctypes.c_int64 * len(parts))(*(_TYPE_IDS[p.type_name] for p in parts))
        self.weight_ptrs = (ctypes.c_void_p * len(parts))(*(p.data.data_ptr() for p in self.parts))
        self.part_rows = (ctypes.c_int64 * len(parts))(*(p.shape[0] for p in parts))
        self._fn = _kernel("linear", dtype)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dtype == self.dtype and x.shape[-1] == self.in_features
        x = x.contiguous()
        y = x.new_empty(x.shape[0], self.out_features)
        bias = None if self.bias is None else self.bias.data_ptr()
        parts = (len(self.parts), self.types, self.weight_ptrs, self.part_rows)
        self._fn(x.data_ptr(), x.shape[0], self.in_features, *parts, bias, y.data_ptr())
        return y


class GGUFExperts:
    """A mixture's experts whose projections are all GGUF tensors, run by the library's grouped
    kernel (gguf_gemm.cpp's gguf_moe): one call a layer, the Python loop over the experts' GEMMs
    (engine/model/moe.py's reference) in C++."""

    def __init__(self, gate_ups: Sequence[GGUFLinear], downs: Sequence[GGUFLinear], dtype: torch.dtype) -> None:
        self.keep = [*gate_ups, *downs]  # their packed tensors hold the bytes the pointers point into
        self.hidden, self.inner = gate_ups[0].in_features, downs[0].in_features
        parts = [p for gu, down in zip(gate_ups, downs, strict=True) for p in (*gu.parts, *down.parts)]
        self.types = (ctypes.c_int64 * len(parts))(*(_TYPE_IDS[p.type_name] for p in parts))
        self.weights = (ctypes.c_void_p * len(parts))(*(p.data.data_ptr() for p in parts))
        self.dtype = dtype
        self._fn = _kernel("moe", dtype)

    @classmethod
    def build(cls, gate_ups: Sequence[object], downs: Sequence[object], dtype: torch.dtype) -> GGUFExperts | None:
        """Where every expert's gate/up is two GGUF tensors (gate, then up) and its down one, without
        biases; else None (the loop runs)."""
        g = [m for m in gate_ups if isinstance(m, GGUFLinear) and m.bias is None and len(m.parts) == 2]
        d = [m for m in downs if isinstance(m, GGUFLinear) and m.bias is None and len(m.parts) == 1]
        if len(g) != len(gate_ups) or len(d) != len(downs):
            return None
        hidden, inner = g[0].in_features, d[0].in_features  # the kernel's sizes, the same for every expert
        gate_up = {(p.shape[0], p.shape[1]) for m in g for p in m.parts}
        down = {(p.shape[0], p.shape[1]) for m in d for p in m.parts}
        return cls(g, d, dtype) if gate_up == {(inner, hidden)} and down == {(hidden, inner)} else None

    def __call__(
        self, x: torch.Tensor, choices: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Adds to out [n, hidden] each token's chosen experts' outputs times their weights: choices
        [n, k] (int64 experts), weights [n, k] (float32); counts [experts] (int64) += tokens per expert."""
        assert x.dtype == out.dtype == self.dtype and weights.dtype == torch.float32 and choices.dtype == torch.int64
        assert counts.dtype == torch.int64 and counts.shape[0] * 3 == len(self.types)
        x, choices, weights = (t.contiguous() for t in (x, choices, weights))
        assert out.is_contiguous() and counts.is_contiguous() and choices.shape == weights.shape
        n, k = choices.shape
        self._fn(
            x.data_ptr(), n, k, choices.data_ptr(), weights.data_ptr(), counts.shape[0], self.hidden, self.inner,
            self.types, self.weights, counts.data_ptr(), out.data_ptr(),
        )  # fmt: skip


class GGUFEmbedding(nn.Module):
    """An embedding whose table is a GGUFWeight [vocab, hidden]: ids [n] -> [n, hidden] in `dtype`."""

    def __init__(self, weight: GGUFWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = weight.packed
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype
        self._fn = _kernel("rows", dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(torch.long).contiguous()
        # The kernel trusts its ids: a bad one is an error here, not a read outside the table.
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        out = torch.empty(ids.shape[0], self.embedding_dim, dtype=self.dtype)
        t = self.table
        self._fn(
            _TYPE_IDS[t.type_name], t.data.data_ptr(), self.embedding_dim, ids.data_ptr(), ids.shape[0], out.data_ptr()
        )
        return out


# Where each type's float16 scales lie in its block: d, and dmin or m where it has one (with the
# multiple of d that centres random values on zero).
_HALVES: dict[str, tuple[int, dict[int, float]]] = {
    "Q4_0": (0, {}),
    "Q4_1": (0, {2: -7.5}),
    "Q5_0": (0, {}),
    "Q5_1": (0, {2: -15.5}),
    "Q8_0": (0, {}),
    "Q4_K": (0, {2: 7.5}),
    "Q5_K": (0, {2: 15.5}),
    "Q6_K": (208, {}),
}


def random_blocks(type_name: str, shape: Sequence[int], rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """Random blocks of `type_name` for a [out, in] weight (tests, and the random-weight models of
    the benchmarks; gguf-py cannot quantize the K-quants): random values and sub-scales, float16
    scales set so that the weights' root mean square is about `std`. uint8 [out, row bytes]."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values, nbytes = BLOCKS[type_name]
    out, inp = int(shape[0]), int(shape[1])
    blocks = rng.integers(0, 256, size=(out, inp // values, nbytes), dtype=np.uint8)
    d, mins = _HALVES[type_name]

    def set_scales(scale: np.ndarray) -> None:
        blocks[..., d : d + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
        for at, centre in mins.items():
            blocks[..., at : at + 2] = (scale * centre).astype(np.float16)[..., None].view(np.uint8)

    set_scales(np.ones(blocks.shape[:2]))
    sample = dequantize(blocks[: min(out, 16)].reshape(-1, nbytes), GGMLQuantizationType[type_name])
    rms = float(np.sqrt(np.mean(np.square(sample, dtype=np.float64))))
    set_scales(rng.uniform(0.5, 1.5, size=blocks.shape[:2]) * std / max(rms, 1e-30))
    return blocks.reshape(out, -1)


def gguf_q8_0(w: torch.Tensor) -> GGUFWeight:
    """A float weight [out, in] as Q8_0 blocks (gguf-py's quantizer, as llama.cpp's): the float part
    of a fused linear whose other parts are GGUF tensors. `in` must be a multiple of 32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    raw = quantize(w.float().numpy(), GGMLQuantizationType.Q8_0)
    return from_blocks("Q8_0", np.ascontiguousarray(raw), w.shape)
