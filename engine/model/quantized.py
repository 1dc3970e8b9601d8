"""Weight-only quantized linears: the weights stay integers in memory and the GEMM reads them so,
through torch's own CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`).

Two formats, each w = dequantized value of one weight of a [out, in] matrix:
- int8, one scale per output row: w = q * scale. A Q8_0 GGUF tensor (int8 in blocks of 32 with
  one scale each) and `--quantization int8` on a float checkpoint both become this; Q8_0's block
  scales fold into the row's scale by requantizing (one rounding of at most half a row step).
- int4 in groups of 32 along the input, a scale and a zero per group: w = (q - 8) * scale + zero,
  q in 0..15. GGUF's Q4_0 (w = (q - 8) * d) and Q4_1 (w = q * d + m, so zero = m + 8d) map onto it
  exactly, up to the rounding of scale and zero to the kernel's dtype.

The kernels take bfloat16 activations (their float32 paths are scalar and 30x slower), so a
float32 model rounds a quantized linear's input and output to bfloat16, as llama.cpp rounds its
activations to 8 bits for its quantized dot products. At batch 1 they read 4-8x fewer bytes than
float32 (scripts/bench_quant.py measures them against the packed float linears at several batch
sizes); on devices other than the CPU the weight is dequantized once at load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATIONS = ("auto", "none", "int8")  # auto: GGUF tensors keep their own types; none: all float
GROUP = 32  # int4 group size along the input (GGUF's block size)
KERNEL_DTYPE = torch.bfloat16
_INT4_ROWS = 16  # the int4 packer wants a multiple of this many output rows
# GGUF types kept quantized, and how many bytes each block of 32 weights takes
GGUF_KEPT = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


@dataclass(frozen=True)
class QuantWeight:
    """A [out, in] weight as integers and scales (see the module doc for the two formats)."""

    bits: int  # 8 or 4
    q: torch.Tensor  # int8 [out, in] (bits 8) or uint8 [out, in] holding 0..15 (bits 4)
    scales: torch.Tensor  # float32 [out, 1] (bits 8) or [out, in / 32] (bits 4)
    zeros: torch.Tensor | None = None  # float32 [out, in / 32] (bits 4)

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float32 weight it stands for (what tests compare the kernels against)."""
        if self.bits == 8:
            return self.q.float() * self.scales
        assert self.zeros is not None
        out, inp = self.shape
        groups = (self.q.float() - 8).view(out, inp // GROUP, GROUP) * self.scales[..., None] + self.zeros[..., None]
        return groups.view(out, inp)

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """The weight with its output rows reordered (llama.cpp's q/k permutation undone)."""
        zeros = None if self.zeros is None else self.zeros[index]
        return QuantWeight(self.bits, self.q[index], self.scales[index], zeros)


def quantize_int8(w: torch.Tensor) -> QuantWeight:
    """Symmetric int8 per output row of a float weight [out, in]: scale = max |w| / 127."""
    w = w.float()
    scales = (w.abs().amax(dim=1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales).clamp_(-127, 127).to(torch.int8)
    return QuantWeight(8, q, scales)


def concat(weights: Sequence[QuantWeight]) -> QuantWeight:
    """Weights of one format stacked along the output (q/k/v or gate/up fused into one GEMM)."""
    if len(weights) == 1:
        return weights[0]
    bits = {w.bits for w in weights}
    if len(bits) != 1:  # a GGUF may mix types within a layer: fall back to the finer one
        return concat([w if w.bits == 8 else quantize_int8(w.dequantize()) for w in weights])
    zeros = None if weights[0].zeros is None else torch.cat([w.zeros for w in weights if w.zeros is not None])
    return QuantWeight(bits.pop(), torch.cat([w.q for w in weights]), torch.cat([w.scales for w in weights]), zeros)


def from_gguf_blocks(type_name: str, raw: np.ndarray, shape: Sequence[int]) -> QuantWeight:
    """A GGUF tensor's raw blocks (uint8, rows of `shape[1] / 32` blocks) as a QuantWeight."""
    out, inp = int(shape[0]), int(shape[1])
    blocks = np.ascontiguousarray(raw).reshape(out, inp // GROUP, GGUF_KEPT[type_name])
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [out, in / 32]
    if type_name == "Q8_0":
        q8 = blocks[..., 2:].copy().view(np.int8).astype(np.float32)  # [out, in / 32, 32]
        return quantize_int8(torch.from_numpy((q8 * d[..., None]).reshape(out, inp)))
    packed = blocks[..., -16:]  # byte j holds weight j (low nibble) and weight j + 16 (high)
    q4 = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(out, inp)
    if type_name == "Q4_0":  # w = (q - 8) * d
        zeros = np.zeros_like(d)
    else:  # Q4_1: w = q * d + m = (q - 8) * d + (m + 8d)
        zeros = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) + 8 * d
    return QuantWeight(4, torch.from_numpy(q4), torch.from_numpy(d), torch.from_numpy(zeros))


class QuantLinear(nn.Module):
    """y = x @ W.T + b with W kept quantized; x: [rows, in] -> [rows, out] in x's dtype."""

    def __init__(
        self, weight: QuantWeight, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bits = weight.bits
        self.kernel = device.type == "cpu"
        self.weight: torch.Tensor
        self.scales: torch.Tensor | None = None
        self.bias: torch.Tensor | None
        if not self.kernel:  # no CPU kernel to run it with: the float weight, dequantized once
            w = weight.dequantize().to(device=device, dtype=dtype)
        elif weight.bits == 8:
            w = weight.q.contiguous()
            self.scales = weight.scales.view(-1).to(KERNEL_DTYPE)
        else:
            assert weight.zeros is not None
            pad = -self.out_features % _INT4_ROWS  # zero rows, sliced off the output
            q = F.pad(weight.q.to(torch.int32), (0, 0, 0, pad))
            w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
            scales_zeros = torch.stack([weight.scales, weight.zeros], dim=-1)  # [out, groups, 2]
            self.scales = F.pad(scales_zeros, (0, 0, 0, 0, 0, pad)).transpose(0, 1).contiguous().to(KERNEL_DTYPE)
        self.register_buffer("weight", w, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.kernel:
            return F.linear(x, self.weight, self.bias)
        xk = x.to(KERNEL_DTYPE)
        if self.bits == 8:
            y = torch.ops.aten._weight_int8pack_mm(xk, self.weight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xk, self.weight, GROUP, self.scales)
            if y.shape[1] != self.out_features:  # the padding rows
                y = y[:, : self.out_features].contiguous()
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias
