"""Linear layers as a stage runs them: projections that read the same input fused into one GEMM,
and on the CPU weights laid out once for the kernel that runs them.

Decode GEMMs are skinny (a handful to a few hundred rows against thousands of columns). There the
BLAS call behind `F.linear` is slow; the weight laid out once for a kernel is not:
- float32: ppserve's own GEMM (engine/model/cpu_gemm.cpp, AVX-512 or AVX2), where the CPU kernel
  library is built: at batch 1 a step reads every weight once, and this kernel reads them at memory
  speed, faster than oneDNN's (by more on AVX2); from 32 rows on the two are about level
  (`python -m benchmarks quant`: docs/models.md#quantized-weights).
- bfloat16: the same GEMM with bfloat16 dot products where the CPU has AVX-512 BF16: faster than
  oneDNN's at a few rows, level from a few hundred rows. With AVX2 alone (where oneDNN has no
  bfloat16 linear) it widens the weights to float, faster than torch's at every row count
  (docs/benchmarks.md#on-a-cpu-with-avx2-alone).
- elsewhere (and without the library): oneDNN with the weights reordered once into its blocked
  layout, faster than `F.linear` at decode shapes, and more so in bfloat16
  (docs/benchmarks.md#where-a-decode-step-goes).
Fusing q/k/v and gate/up turns five calls per layer into two wider ones.

The checkpoint is loaded into the usual `nn.Linear` modules (their names are the checkpoint's);
`fuse_linears` then builds one `Linear` per group from their weights and the originals are
dropped, so the laid-out copy is the only one held.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ppserve.engine.model import cpu_kernels, huge_pages
from ppserve.engine.model.gguf_quant import GGUFLinear, GGUFWeight, gguf_kernels_available, gguf_q8_0
from ppserve.engine.model.kernel_choice import ROWS, SAMPLE_ROWS, KernelChooser, bucket
from ppserve.engine.model.quantized import GGUF_KEPT, QuantLinear, QuantWeight, concat, from_gguf_blocks, quantize_int8

# oneDNN picks its blocking for this many rows; the packed weight serves any row count.
PACK_ROWS_HINT = 64
# oneDNN's kernels for one to three rows read the packed weight slower than its four-row one, so
# fewer rows are padded to four with zeros and the extra outputs dropped.
MIN_ROWS = 4
PACKED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
LANES = 32  # output rows per group of ppserve's float GEMM (cpu_gemm.cpp)
KERNELS = ("ppserve", "onednn", "torch")


def default_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """The kernel a `Linear` of `dtype` on `device` runs by default (see the module doc)."""
    if cpu_kernels.float_gemm_available(device, dtype):
        return "ppserve"
    return "onednn" if onednn_available(device, dtype) else "torch"


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear runs `dtype` on `device`: its bfloat16 path needs AVX-512
    (BW, VL, DQ) or AVX-NE-CONVERT, which CPUs with AVX2 alone lack."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN linear runs `rows` at: at least MIN_ROWS, and rounded up to one of a
    few sizes, since oneDNN makes (JIT-compiles) a kernel for each new shape. Unpadded, a server's
    first minutes paid that for every batch size, 1 to 256, and every prefill chunk size
    (docs/benchmarks.md#against-vllm-and-llamacpp)."""
    if rows <= MIN_ROWS:
        return MIN_ROWS
    step = 8 if rows <= 256 else 64  # decode sizes are memory-bound: 7 more rows cost little there
    return -(-rows // step) * step


def pack_float_lanes(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [groups, in, 32] for ppserve's float GEMM: output rows in groups of 32 (the last
    padded with zero rows), a group's 32 weights of one input side by side. In bfloat16, of one pair
    of inputs: [groups, in / 2, 32, 2] (in even), as the CPU's bfloat16 dot products take them."""
    out, inp = weight.shape
    groups = -(-out // LANES)
    padded = F.pad(weight, (0, 0, 0, groups * LANES - out))
    if weight.dtype == torch.bfloat16:
        return huge_pages.like(padded.view(groups, LANES, inp // 2, 2).transpose(1, 2))
    return huge_pages.like(padded.view(groups, LANES, inp).transpose(1, 2))


def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """An MLP's [gate; up] weight ([2 * dim, in]) or bias ([2 * dim]) in float_gemm_silu's order:
    16 rows of gate, the same 16 of up, the next 16 of gate, and so on (dim a multiple of 16)."""
    gate, up = t.chunk(2)
    return torch.stack([gate.unflatten(0, (-1, 16)), up.unflatten(0, (-1, 16))], dim=1).flatten(0, 2)


class _Layout(nn.Module):
    """A weight laid out for one kernel of KERNELS, and that kernel's call (see `Linear`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str, gated: bool) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.kernel = kernel
        if self.kernel == "ppserve" and weight.dtype == torch.bfloat16 and weight.shape[1] % 2:
            self.kernel = "onednn"  # the bfloat16 GEMM takes its inputs in pairs
        if self.kernel == "onednn" and not onednn_available(weight.device, weight.dtype):
            self.kernel = "torch"  # what this CPU lacks, torch's own matmul does
        self.gemm: cpu_kernels.FloatGemm | None = None
        self.silu = gated and self.kernel == "ppserve" and self.out_features % 32 == 0 and weight.dtype == torch.float32
        if self.silu:
            weight, bias = interleave_gate_up(weight), None if bias is None else interleave_gate_up(bias)
        if self.kernel == "ppserve":
            w = pack_float_lanes(weight)
            self.gemm = cpu_kernels.FloatGemm(w, bias, self.out_features, silu=self.silu)
        elif self.kernel == "onednn":
            w = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
        else:
            w = weight
        self.weight: torch.Tensor
        self.bias: torch.Tensor | None
        self.register_buffer("weight", w, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm is not None:
            return self.gemm(x)
        if self.kernel == "onednn":
            rows = x.shape[0]
            if (padded := onednn_rows(rows)) != rows:
                x = F.pad(x, (0, 0, 0, padded - rows))
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")[:rows]
        return F.linear(x, self.weight, self.bias)


class Linear(nn.Module):
    """y = x @ W.T + b for x: [rows, in_features] -> [rows, out_features]; with `silu` (an MLP's
    gate and up projections, see `__init__`), SiLU(gate) * up: [rows, out_features // 2]."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kernel: str | Sequence[str] | None = None,
        gated: bool = False,
    ) -> None:
        """`kernel`: one of KERNELS (`python -m benchmarks kernel-choice` times them), or one per row
        count of kernel_choice.ROWS (the chooser's, engine/model/kernel_choice.py: the weight is laid
        out for each kernel named); by default `default_kernel`. `gated`: the weight is an MLP's
        [gate; up]. Where ppserve's GEMM runs it, the SiLU is done on its output registers (`silu` is
        then True, and the other kernel's output goes through the SiLU kernel); elsewhere the caller
        applies it."""
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        if kernel is None or isinstance(kernel, str):
            kernel = (kernel or default_kernel(weight.device, weight.dtype),) * len(ROWS)
        assert len(kernel) == len(ROWS), kernel
        made = {name: _Layout(weight, bias, name, gated) for name in dict.fromkeys(kernel)}
        self.layouts = nn.ModuleDict(made)
        self.by_bucket = [made[name] for name in kernel]  # each row count's layout (kernel_choice.bucket)
        self.kernels = tuple(layout.kernel for layout in self.by_bucket)
        self.kernel = self.kernels[0]  # a decode step's, at one row
        self.gemm = self.by_bucket[0].gemm
        self.silu = any(layout.silu for layout in made.values())
        self.one_kernel = len(made) == 1  # the usual case: no row count to look at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layout = self.by_bucket[0] if self.one_kernel else self.by_bucket[bucket(x.shape[0])]
        y = layout(x)
        return cpu_kernels.silu_mul(y) if self.silu and not layout.silu else y


AnyLinear = Linear | QuantLinear | GGUFLinear  # what a fused projection of the forward pass is


def fuse_linears(
    linears: Sequence[nn.Linear],
    dtype: torch.dtype,
    device: torch.device,
    int8: bool = False,
    gated: bool = False,
    chooser: KernelChooser | None = None,
) -> AnyLinear:
    """One linear whose output is the given layers' outputs side by side (same input); `gated`: they
    are an MLP's gate and up projections (see `Linear`); `chooser`: a float linear's kernels are
    its choice (engine/model/kernel_choice.py), else the default.

    A layer loaded as a quantized weight (its `quant` attribute, engine/model/weights.py) stays
    quantized, and so does the group; `int8` quantizes float weights to int8 (--quantization int8):
    as GGUF's Q8_0 blocks where the CPU lacks AVX-512 VNNI (the blocks' kernel has AVX2 code;
    torch's int8 kernel computes in bfloat16, a scale per row)."""
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        bias = None
    else:  # a group mixing biased and unbiased layers gets zeros for the latter
        bias = torch.cat(
            [
                b.detach() if b is not None else torch.zeros(lin.out_features, dtype=dtype, device=device)
                for lin, b in zip(linears, biases, strict=True)
            ]
        )
    quants: list[QuantWeight | GGUFWeight | None] = [getattr(lin, "quant", None) for lin in linears]
    blocks = int8 and gguf_kernels_available(device, dtype) and not cpu_kernels.quant_gemm_available(device, dtype)
    if any(isinstance(q, GGUFWeight) for q in quants) or (blocks and linears[0].in_features % 32 == 0):
        ggufs = [
            q if isinstance(q, GGUFWeight) else gguf_q8_0(lin.weight.detach())
            for lin, q in zip(linears, quants, strict=True)
        ]
        if not _runs_packed(ggufs, dtype, device):
            return GGUFLinear(ggufs, bias, dtype)
        quants = [from_gguf_blocks(q.type_name, q.raw.numpy(), q.shape) for q in ggufs]
    if int8 or any(q is not None for q in quants):
        ws = [
            q if isinstance(q, QuantWeight) else quantize_int8(lin.weight.detach())
            for lin, q in zip(linears, quants, strict=True)
        ]
        return QuantLinear(concat(ws), bias, dtype, device)
    weight = torch.cat([lin.weight.detach() for lin in linears]) if len(linears) > 1 else linears[0].weight.detach()
    weight = weight.contiguous()
    return Linear(weight, bias, None if chooser is None else chosen_kernels(chooser, weight, bias, gated), gated)


def candidates(device: torch.device, dtype: torch.dtype, in_features: int) -> list[str]:
    """The kernels of KERNELS that run a float linear of this kind here, each as itself."""
    names = ["torch"]
    if onednn_available(device, dtype):
        names.insert(0, "onednn")
    if cpu_kernels.float_gemm_available(device, dtype) and (dtype != torch.bfloat16 or in_features % 2 == 0):
        names.insert(0, "ppserve")
    return names


def chosen_kernels(
    chooser: KernelChooser, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool
) -> tuple[str, ...] | None:
    """The chooser's kernel per row count for this weight, or None (the default) where one kernel
    runs it. The kernels are timed on at most SAMPLE_ROWS of its output rows (gate's and up's
    alike), with the bias and the SiLU as the linear has them."""
    names = candidates(weight.device, weight.dtype, weight.shape[1])
    if len(names) < 2:
        return None
    sample, sample_bias = weight[:SAMPLE_ROWS], None if bias is None else bias[:SAMPLE_ROWS]
    if gated and weight.shape[0] > SAMPLE_ROWS:
        half = SAMPLE_ROWS // 2
        sample = torch.cat([t[:half] for t in weight.chunk(2)])
        sample_bias = None if bias is None else torch.cat([t[:half] for t in bias.chunk(2)])
    dtype = cpu_kernels.KERNEL_DTYPES[weight.dtype]
    shape = (
        f"{dtype} {sample.shape[0]}x{sample.shape[1]}{' gated' if gated else ''}{' bias' if bias is not None else ''}"
    )

    def run() -> dict[str, Callable[[int], object]]:
        x = torch.randn(max(ROWS), weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        linears = {name: Linear(sample.contiguous(), sample_bias, name, gated) for name in names}
        return {name: functools.partial(lambda lin, n: lin(x[:n]), lin) for name, lin in linears.items()}

    return chooser.kernels(shape, names, run)


def _runs_packed(weights: Sequence[GGUFWeight], dtype: torch.dtype, device: torch.device) -> bool:
    """Whether GGUF tensors run as QuantLinear's integers (engine/model/quantized.py) rather than as
    their blocks (engine/model/gguf_quant.py): where the blocks' kernel is not built (weights.py
    then keeps only the types QuantLinear takes), and for those types on CPUs with ppserve's own
    AVX-512 VNNI kernel, which they map onto exactly."""
    if not gguf_kernels_available(device, dtype):
        return True
    return cpu_kernels.quant_gemm_available(device, dtype) and all(w.type_name in GGUF_KEPT for w in weights)
