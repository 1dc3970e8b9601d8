"""Weight-only quantized linears: the weights stay integers in memory and every GEMM reads them so.

Two formats, each w = dequantized value of one weight of a [out, in] matrix:
- int8 in blocks of 32 along the input, one scale each: w = q * scale. GGUF's Q8_0 is exactly this,
  and `--quantization int8` quantizes a float checkpoint so (max |w| / 127 per block).
- int4 in groups of 32, a scale and a zero per group: w = (q - 8) * scale + zero, q in 0..15.
  GGUF's Q4_0 (w = (q - 8) * d) and Q4_1 (w = q * d + m, so zero = m + 8d) map onto it exactly.

Two CPU kernels run them:
- ppserve's own (engine/model/cpu_gemm.cpp, on CPUs with AVX-512 VNNI): the activations are
  rounded to int8 in blocks of 32, as llama.cpp does for its quantized dot products, and multiplied
  in integers. The weights are repacked for it at load, scales as float16 (the GGUF's own values).
- torch's `_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm` elsewhere: bfloat16 activations,
  one scale per row for int8 (a Q8_0 block's scale is folded into its row's by requantizing).
At batch 1 they read 4-8x fewer bytes than float32 (`python -m benchmarks quant` times both against
the packed float linears: docs/models.md#quantized-weights); on devices other than the CPU the
weight is dequantized once at load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ppserve.engine.model import cpu_kernels

QUANTIZATIONS = ("auto", "none", "int8")  # auto: GGUF tensors keep their own types; none: all float
GROUP = 32  # int4 group size along the input (GGUF's block size)
KERNEL_DTYPE = torch.bfloat16
_INT4_ROWS = 16  # torch's int4 packer wants a multiple of this many output rows
LANES = 16  # output rows side by side in ppserve's kernel (one per lane of a 512-bit register)
# GGUF types kept quantized, and how many bytes each block of 32 weights takes
GGUF_KEPT = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


@dataclass(frozen=True)
class QuantWeight:
    """A [out, in] weight as integers and scales (see the module doc for the two formats)."""

    bits: int  # 8 or 4
    q: torch.Tensor  # int8 [out, in] (bits 8) or uint8 [out, in] holding 0..15 (bits 4)
    scales: torch.Tensor  # float32 [out, in / 32] (bits 8 also [out, 1]: one per row)
    zeros: torch.Tensor | None = None  # float32 [out, in / 32] (bits 4)

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float32 weight it stands for (what tests compare the kernels against)."""
        out, inp = self.shape
        groups = self.scales.shape[1]
        values = self.q.float().view(out, groups, inp // groups)
        if self.bits == 8:
            return (values * self.scales[..., None]).view(out, inp)
        assert self.zeros is not None
        return ((values - 8) * self.scales[..., None] + self.zeros[..., None]).view(out, inp)

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """The weight with its output rows reordered (llama.cpp's q/k permutation undone)."""
        zeros = None if self.zeros is None else self.zeros[index]
        return QuantWeight(self.bits, self.q[index], self.scales[index], zeros)


def quantize_int8(w: torch.Tensor, group: int = GROUP) -> QuantWeight:
    """Symmetric int8 of a float weight [out, in] in blocks of `group` inputs (whole rows where `in` is
    not a multiple of it): scale = max |w| / 127, rounded to float16 as the kernel stores it."""
    out, inp = w.shape
    size = group if inp % group == 0 else inp
    blocks = w.float().view(out, inp // size, size)
    scales = (blocks.abs().amax(dim=-1) / 127).clamp_min(2.0**-24).half().float()  # float16's least step
    q = torch.round(blocks / scales[..., None]).clamp_(-127, 127).to(torch.int8)
    return QuantWeight(8, q.view(out, inp), scales)


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
        q8 = blocks[..., 2:].copy().view(np.int8).reshape(out, inp)
        return QuantWeight(8, torch.from_numpy(q8), torch.from_numpy(d))
    packed = blocks[..., -16:]  # byte j holds weight j (low nibble) and weight j + 16 (high)
    q4 = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(out, inp)
    if type_name == "Q4_0":  # w = (q - 8) * d
        zeros = np.zeros_like(d)
    else:  # Q4_1: w = q * d + m = (q - 8) * d + (m + 8d)
        zeros = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) + 8 * d
    return QuantWeight(4, torch.from_numpy(q4), torch.from_numpy(d), torch.from_numpy(zeros))


def pack_lanes(weight: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(weights, scales, mins) laid out for cpu_kernels.QuantGemm (cpu_gemm.cpp draws the layout):
    output rows in groups of 16 (the last padded with zero rows), each group's blocks of 32 inputs
    with the 16 rows' bytes side by side; scales and mins float16 [groups, in / 32, 16]."""
    out, inp = weight.shape
    groups, blocks = -(-out // LANES), inp // GROUP
    pad = groups * LANES - out

    def lanes(t: torch.Tensor) -> torch.Tensor:  # [out, blocks] -> [groups, blocks, 16]
        return F.pad(t, (0, 0, 0, pad)).view(groups, LANES, blocks).transpose(1, 2).contiguous().half()

    q = F.pad(weight.q, (0, 0, 0, pad))
    scales = weight.scales.expand(out, blocks)  # a row's one scale (int8 per row) for each block
    if weight.bits == 4:
        assert weight.zeros is not None
        nibbles = q.view(groups, LANES, blocks, 2, 4, 4)  # input j = 16 * half + 4 * chunk + byte
        packed = nibbles[:, :, :, 0] | (nibbles[:, :, :, 1] << 4)  # [groups, 16, blocks, chunk, byte]
        mins = weight.zeros - 8 * weight.scales  # w = q * scale + min
        return packed.permute(0, 2, 3, 1, 4).contiguous(), lanes(scales), lanes(mins)
    offset = (q.to(torch.int16) + 128).to(torch.uint8).view(groups, LANES, blocks, 8, 4)  # j = 4 * chunk + byte
    return offset.permute(0, 2, 3, 1, 4).contiguous(), lanes(scales), None


class QuantLinear(nn.Module):
    """y = x @ W.T + b with W kept quantized; x: [rows, in] -> [rows, out] in x's dtype."""

    def __init__(
        self,
        weight: QuantWeight,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        device: torch.device,
        kernel: str | None = None,
    ) -> None:
        """`kernel`: "ppserve" or "torch" on the CPU (`python -m benchmarks quant` times both); by
        default ppserve's where it runs."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bits = weight.bits
        own = cpu_kernels.quant_gemm_available(device, dtype) and self.in_features % GROUP == 0
        if device.type != "cpu":  # no CPU kernel to run it with: the float weight, dequantized once
            self.kernel = "none"
        else:
            self.kernel = kernel or ("ppserve" if own else "torch")
            assert self.kernel == "torch" or own, "ppserve's quantized kernel does not run here"
        self.weight: torch.Tensor
        self.scales: torch.Tensor | None = None
        self.mins: torch.Tensor | None = None
        self.bias: torch.Tensor | None
        if self.kernel == "none":
            w = weight.dequantize().to(device=device, dtype=dtype)
        elif self.kernel == "ppserve":
            w, self.scales, self.mins = pack_lanes(weight)
        elif weight.bits == 8:  # torch's kernel scales whole rows
            if weight.scales.shape[1] != 1:
                weight = quantize_int8(weight.dequantize(), group=self.in_features)
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
        self.dtype = dtype
        self.gemm: cpu_kernels.QuantGemm | None = None
        self._bind()

    def _bind(self) -> None:
        if self.kernel == "ppserve":
            assert self.scales is not None
            self.gemm = cpu_kernels.QuantGemm(
                self.bits, self.weight, self.scales, self.mins, self.bias, self.out_features, self.dtype
            )

    def _apply(self, fn: Any, recurse: bool = True) -> QuantLinear:
        super()._apply(fn, recurse)
        self._bind()  # the buffers may be new tensors: the kernel's pointers go with them
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm is not None:
            return self.gemm(x)
        if self.kernel == "none":
            return F.linear(x, self.weight, self.bias)
        assert self.scales is not None
        xk = x.to(KERNEL_DTYPE)
        if self.bits == 8:
            y = torch.ops.aten._weight_int8pack_mm(xk, self.weight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xk, self.weight, GROUP, self.scales)
            if y.shape[1] != self.out_features:  # the padding rows
                y = y[:, : self.out_features].contiguous()
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias
