"""The CPU kernels of the forward pass (cpu_kernels.cpp, cpu_gemm.cpp): built once per machine into
one library, loaded with ctypes.

- Decode attention: SDPA needs each request's keys and values gathered into one padded tensor
  first, and its flash kernel is tuned for many queries; for one query per request the gather
  and the kernel cost several times what reading the cache once does
  (docs/benchmarks.md#where-a-decode-step-goes). The kernel reads the cache in place, with AVX-512
  or, on x86 CPUs without it, AVX2 loops written out by hand (the compiler's own vectorization of
  the plain loops was several times slower: docs/benchmarks.md#k-quant-gguf-files-against-llamacpp).
- Prefill attention: torch's flash SDPA runs far below the CPU's arithmetic peak at a few hundred
  tokens a prompt; the kernel's tiles of keys in registers, shared by the query heads of a kv head,
  do much better (bfloat16 dot products where the CPU has AVX-512 BF16; built only there;
  docs/benchmarks.md#against-vllm-and-llamacpp).
- The glue of a decoder layer: residual add with RMSNorm, SiLU(gate) * up, RoPE on q and k with
  the KV cache write. In torch these are some twenty ops per layer, each a dispatch and a pass
  over memory; on a thin, deep model at small batches they cost as much as the GEMMs.
- Constrained decoding's token bitmask applied to the logits (one pass over a row, far cheaper
  than unpacking the bits with torch ops).
- The float32 (AVX-512 or AVX2) and bfloat16 GEMMs of the linears (engine/model/linear.py): a
  model's step at batch 1 is mostly one read of its weights, which oneDNN's kernels for a few rows
  do well below the memory's speed; ppserve's reads them at memory speed, and keeps level with
  oneDNN's at prefill sizes (docs/models.md#quantized-weights). The bfloat16 one (CPUs with
  AVX-512 BF16) also spares a decode step its calls back into Python for oneDNN.
- GGUF's quantized tensors (Q4_K, Q5_K, Q6_K, Q5_0 and the rest), repacked at load
  (gguf_gemm.cpp, engine/model/gguf_quant.py): a linear and an embedding lookup, on any CPU.
- The GEMM of weights kept as 4- or 8-bit integers (engine/model/quantized.py), with int8
  activations and integer dot products, as llama.cpp runs its quantized files; torch's own int4
  and int8 kernels compute in bfloat16 and read the weights well below the memory's speed at
  batch 1 (docs/models.md#quantized-weights). Built only where the CPU has AVX-512 VNNI; elsewhere
  torch's kernels run.

The library is compiled with the system's g++ at the first stage start on a machine (a few
seconds) into `kernels/` of the cache directory (engine/model/cache_dir.py: ~/.cache/ppserve by
default), keyed by the source, the compiler and the CPU's flags, and loaded from there
afterwards. Where there is no compiler, or the build fails, the model runs the torch ops (and
SDPA), with one warning; so it does on other devices and dtypes than float32 and bfloat16.

Whether to use it and where to build it come from the engine config (`cpu_kernels`,
`cache_dir`), which each stage hands over through `configure` before its first step.

Which of the C++'s instruction-set paths it is built with is the machine's own choice, read from
$PPSERVE_CPU_ISA when the library is loaded: `native` (the default: whatever this CPU has),
`avx2` (an x86-64-v3 CPU's: AVX2, FMA and F16C, never AVX-512) or `scalar` (baseline x86-64:
the plain C++ paths only). An AVX-512 machine thus also tests the code that AVX2-only CPUs run,
and any x86 machine the fallbacks (tests/model/test_kernel_variants.py). A variant this CPU cannot run,
or an unknown name, builds `native`, with one warning; each variant is a library of its own in
the cache, and `isa()` says which one is loaded.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ppserve.engine.model.cache_dir import cache_dir

log = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name(name)
    for name in ("cpu_kernels.cpp", "cpu_gemm.cpp", "cpu_gemm_avx2.cpp", "decode_step.cpp", "gguf_gemm.cpp")
]
HEADER = Path(__file__).with_name("cpu_kernels.h")
KERNEL_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # each kernel's name suffix
_PTR, _INT64, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# A linear that the decode step leaves to its caller (decode_step.cpp's LinearFn): (layer, which,
# rows) -> the output's address, 0 on failure.
LINEAR_FN = ctypes.CFUNCTYPE(ctypes.c_int64, _INT64, _INT64, _INT64)
_ARGTYPES = {
    "decode_attention": [_PTR] * 6 + [_INT64] * 6 + [_FLOAT, _INT64],
    "rms_norm": [_PTR] * 4 + [_INT64] * 2 + [_FLOAT],
    "silu_mul": [_PTR] * 2 + [_INT64] * 2,
    "gelu_mul": [_PTR] * 2 + [_INT64] * 2,
    "rope_write_kv": [_PTR, _INT64, _PTR, _INT64, _PTR, _INT64] + [_PTR] * 5 + [_INT64] * 4,
    # A decode step's layers in one call (engine/model/decode_step.py); it returns nonzero on failure.
    "decode_layers": [_PTR, _INT64, _PTR, _PTR, LINEAR_FN] + [_PTR] * 3 + [_INT64] * 2,
}
# Float32 only: the sampler's logits.
_F32_ARGTYPES = {
    "apply_token_bitmask": [_PTR, _INT64, _PTR, _INT64, _PTR, _INT64, _INT64],
    "argmax_rows": [_PTR, _INT64, _INT64, _INT64, _PTR],
}
# Built only for some CPUs (see cpu_gemm.cpp): each present or absent as a whole.
_QUANT_ARGTYPES = {"quant_gemm_q4": [_PTR] * 6 + [_INT64] * 3, "quant_gemm_q8": [_PTR] * 6 + [_INT64] * 3}
_FLOAT_GEMM_ARGTYPES = {name: [_PTR] * 4 + [_INT64] * 3 for name in ("float_gemm", "float_gemm_silu")}  # float32 only
# Built only where the CPU has AVX-512 with bfloat16 dot products (cpu_kernels.cpp); elsewhere SDPA runs.
_PREFILL_ARGTYPES = {"prefill_attention": [_PTR, _INT64] * 3 + [_PTR] + [_INT64] * 7 + [_FLOAT, _INT64]}
# Sums may be reordered (that is what lets the loops vectorize; the result differs from SDPA's
# by rounding only), but NaN and infinity keep their meaning: no -ffast-math. libmvec has the
# vector expf.
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
FLAGS += ["-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros"]
# Per variant ($PPSERVE_CPU_ISA, see the module's docstring): the flags that pick the instruction
# set, and the CPU flags (/proc/cpuinfo) its code needs.
ISA_ENV = "PPSERVE_CPU_ISA"
ISA_FLAGS = {
    # GCC vectorizes for 256-bit registers on AVX-512 CPUs unless told otherwise, and the
    # elementwise loops run faster at 512 bits (docs/benchmarks.md#against-vllm-and-llamacpp).
    "native": ["-march=native", "-mprefer-vector-width=512"],
    # What an AVX2 CPU without AVX-512 has (Haswell, Zen 1-3).
    "avx2": ["-march=x86-64-v3"],
    # The -mno-* keep every __AVX*__, __F16C__ and __FMA__ path out, whatever the compiler's defaults.
    "scalar": ["-march=x86-64", "-mno-avx", "-mno-avx2", "-mno-f16c", "-mno-fma"],
}
ISA_NEEDS = {
    "native": frozenset[str](),
    # x86-64-v3 as a whole: the compiler may emit its BMI, LZCNT (abm) and MOVBE instructions too.
    "avx2": frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "xsave"}),
    "scalar": frozenset({"sse2"}),  # any x86-64
}


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def can_run(variant: str) -> bool:
    """Whether this CPU runs the code of `variant` (a key of ISA_FLAGS)."""
    return ISA_NEEDS[variant] <= set(cpu_flags().split())


@functools.cache  # one warning per value, however often the library is loaded again
def _variant(requested: str) -> str:
    """The variant to build for $PPSERVE_CPU_ISA's value: `native` where it is unknown or this CPU
    cannot run it (rather than a library that dies of an illegal instruction)."""
    if requested not in ISA_FLAGS:
        log.warning("%s=%r is none of %s: building the CPU kernels native", ISA_ENV, requested, ", ".join(ISA_FLAGS))
        return "native"
    if not can_run(requested):
        missing = " ".join(sorted(ISA_NEEDS[requested] - set(cpu_flags().split())))
        log.warning("%s=%s needs CPU flags this CPU lacks (%s): building native", ISA_ENV, requested, missing)
        return "native"
    return requested


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


# (enabled, cache directory) of the config this process runs; None: not configured (a script that
# drives the model directly), then on. A cache directory of "" is the default one.
_settings: tuple[bool, str] | None = None


def configure(enabled: bool, cache: str) -> None:
    """Take the engine config's settings (a process runs the stages of one config)."""
    global _settings
    _settings = (enabled, cache)
    load.cache_clear()
    _kernel.cache_clear()


@functools.cache  # a layer asks several times a step: the answer is kept until `configure`
def load() -> ctypes.CDLL | None:
    """The built kernel library, or None where it is switched off or cannot be built (then the
    torch ops are used)."""
    enabled, cache = _settings or (True, "")
    if not enabled:
        return None
    return _load(cache or str(cache_dir()), _variant(os.environ.get(ISA_ENV, "").strip().lower() or "native"))


# Each library loaded -> the variant it was built for (`isa`).
_ISA_OF: dict[ctypes.CDLL, str] = {}


def isa() -> str | None:
    """The instruction-set variant the loaded library was built for ("native", "avx2" or "scalar";
    see the module's docstring), None where there is no library."""
    dll = load()
    return None if dll is None else _ISA_OF.get(dll)


@functools.cache
def _load(cache: str, variant: str) -> ctypes.CDLL | None:
    cxx = _compiler()
    if cxx is None:
        log.warning("no C++ compiler found: the forward pass runs torch ops only (slower on the CPU)")
        return None
    cmd = [cxx, *ISA_FLAGS[variant], *FLAGS]
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
        texts = [f.read_text() for f in (*SOURCES, HEADER)]
        key = hashlib.sha256(" ".join([*texts, version, cpu_flags(), variant, *cmd]).encode()).hexdigest()[:16]
        lib = Path(cache) / "kernels" / f"cpu_kernels-{variant}-{key}.so"
        if not lib.exists():
            log.info("building the CPU kernels for this machine (once, about half a minute): %s", lib.name)
            lib.parent.mkdir(parents=True, exist_ok=True)
            # Built under a temporary name and renamed: stages starting at once each build, and
            # the rename makes whichever finishes first the one the others load.
            with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
                out = Path(tmp) / lib.name
                subprocess.run(
                    [*cmd, *map(str, SOURCES), "-o", str(out), "-lmvec"], capture_output=True, text=True, check=True
                )
                os.replace(out, lib)
        dll = ctypes.CDLL(str(lib))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.strip().splitlines()[-1:] if isinstance(e, subprocess.CalledProcessError) else [str(e)]
        log.warning("cannot build the CPU kernels (%s): the forward pass runs torch ops only", *detail or ["?"])
        return None
    log.debug("CPU kernels: the %s build, %s", variant, lib)
    _ISA_OF[dll] = variant
    kernels = _ARGTYPES | (_QUANT_ARGTYPES if hasattr(dll, "quant_gemm_q4_f32") else {})
    kernels |= _PREFILL_ARGTYPES if hasattr(dll, "prefill_attention_f32") else {}
    for name, argtypes in kernels.items():
        for suffix in KERNEL_DTYPES.values():
            fn = getattr(dll, f"{name}_{suffix}")
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int if name in ("decode_layers", "prefill_attention") else None
    f32 = _F32_ARGTYPES | (_FLOAT_GEMM_ARGTYPES if hasattr(dll, "float_gemm_f32") else {})
    for name, argtypes in f32.items():
        fn = getattr(dll, f"{name}_f32")
        fn.argtypes, fn.restype = argtypes, None
    if hasattr(dll, "float_gemm_bf16"):
        dll.float_gemm_bf16.argtypes, dll.float_gemm_bf16.restype = _FLOAT_GEMM_ARGTYPES["float_gemm"], None
    return dll


def library_name() -> str:
    """The loaded library's file name (it names its build: variant and a hash of source, compiler
    and CPU flags), "" where there is none."""
    dll = load()
    return "" if dll is None else Path(dll._name).name


def available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in KERNEL_DTYPES and load() is not None


def float_gemm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `FloatGemm` runs here: the library built with its float GEMM for `dtype` (float32 with
    AVX-512 or AVX2; bfloat16 with AVX-512 BF16, or AVX2 widening it to float)."""
    return available(device, dtype) and hasattr(load(), f"float_gemm_{KERNEL_DTYPES[dtype]}")


class PackedGemm:
    """y = x @ W.T + bias by one of the library's GEMMs (cpu_gemm.cpp: `kernel`), for one weight laid
    out for it; `tensors` are the kernel's weight arguments in order, the bias last. Its pointers are
    looked up once: a step calls this some hundred times."""

    def __init__(
        self,
        kernel: str,
        dtype: torch.dtype,
        tensors: tuple[torch.Tensor | None, ...],
        out_features: int,
        rows: int | None = None,
    ) -> None:
        """`rows`: the weight's rows (the kernel's N), where they are not `out_features`."""
        self.kernel, self.dtype, self.out_features = kernel, dtype, out_features
        self.rows = out_features if rows is None else rows
        self.fn = _kernel(kernel, dtype)
        self.tensors = tensors  # alive as long as their pointers are
        self.pointers = tuple(None if t is None else t.data_ptr() for t in tensors)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in] of the dtype given -> [rows, out_features]."""
        assert x.dtype == self.dtype
        x = x.contiguous()
        y = x.new_empty(x.shape[0], self.out_features)
        self.fn(x.data_ptr(), *self.pointers, y.data_ptr(), x.shape[0], self.rows, x.shape[1])
        return y


class FloatGemm(PackedGemm):
    """ppserve's float32 or bfloat16 GEMM (the weight's dtype), W laid out as engine/model/linear.py
    packs it. With `silu` (float32 only), W is an MLP's gate and up projections interleaved
    (linear.py's `interleave_gate_up`), and the output SiLU(gate) * up, half as wide."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int, silu: bool = False) -> None:
        tensors, dtype = (weight, bias), weight.dtype
        if silu:
            assert dtype == torch.float32
            super().__init__("float_gemm_silu", dtype, tensors, out_features // 2, out_features)
        else:
            super().__init__("float_gemm", dtype, tensors, out_features)


def decode_layers(dtype: torch.dtype) -> Callable[..., int] | None:
    """The library's decode step for `dtype` (engine/model/decode_step.py), or None where it is not built."""
    return _kernel("decode_layers", dtype) if available(torch.device("cpu"), dtype) else None


def quant_gemm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `QuantGemm` runs here (the library is built, and with its quantized GEMM)."""
    return available(device, dtype) and hasattr(load(), "quant_gemm_q4_f32")


class QuantGemm(PackedGemm):
    """The quantized GEMM, for one weight as engine/model/quantized.py packs it (`mins` for 4 bits
    only); the input's width must be a multiple of 32."""

    def __init__(
        self,
        bits: int,
        weight: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        bias: torch.Tensor | None,
        out_features: int,
        dtype: torch.dtype,
    ) -> None:
        assert (mins is not None) == (bits == 4) and (bias is None or bias.dtype == dtype)
        super().__init__(f"quant_gemm_q{bits}", dtype, (weight, scales, mins, bias), out_features)


def apply_token_bitmask(logits: torch.Tensor, masks: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf wherever bit t of masks[i] is clear. logits: [*, vocab]
    float32 with unit stride in its last dimension; masks: [len(rows), words] int32, contiguous;
    rows: int64. Only where `available(logits.device, torch.float32)`."""
    assert logits.dtype == torch.float32 and logits.stride(1) == 1 and masks.is_contiguous()
    assert masks.dtype == torch.int32 and rows.dtype == torch.int64 and masks.shape[0] == rows.shape[0]
    rows = rows.contiguous()
    _kernel("apply_token_bitmask", torch.float32)(
        logits.data_ptr(), logits.stride(0), masks.data_ptr(), masks.shape[1], rows.data_ptr(), rows.shape[0],
        logits.shape[1],
    )  # fmt: skip


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) for logits [rows, vocab] float32 with unit stride in its last
    dimension (the first index of the largest, or of the first NaN). Only where
    `available(logits.device, torch.float32)`."""
    assert logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1
    out = torch.empty(logits.shape[0], dtype=torch.long)
    _kernel("argmax_rows", torch.float32)(
        logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], out.data_ptr()
    )
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """q: [batch, heads, head_dim] (one query per request) -> [batch, heads, head_dim].

    caches: [num_blocks, block_size, kv_heads, head_dim]; block_tables: [batch, max_blocks] int64;
    context_lens: [batch] int64, keys per request (the query's position + 1).
    """
    q = q.contiguous()
    out = torch.empty_like(q)
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert heads // kv_heads <= 64 and q.dtype == k_cache.dtype
    _kernel("decode_attention", q.dtype)(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        context_lens.data_ptr(),
        out.data_ptr(),
        batch,
        heads,
        kv_heads,
        head_dim,
        block_size,
        block_tables.shape[1],
        scale,
        window or 0,
    )
    return out


def prefill_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `prefill_attention` runs here (the library built with it, a head_dim it has)."""
    return head_dim in (64, 128) and available(device, dtype) and hasattr(load(), "prefill_attention_f32")


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: int,
    scale: float,
    window: int | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of `batch` prompt chunks of equal length over their prompts' keys.

    q: [batch * nq, heads, head_dim]; k, v: [batch * nk, kv_heads, head_dim] (rows may have any
    stride, each row's heads contiguous: the views of a fused projection). Prompt b's query i is at
    position nk - nq + i and sees its keys up to there (the last `window` of them, if given).
    Returns [batch * nq, heads, head_dim]: `out` where given (laid out as q may be).
    """
    rows, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    for t in (q, k, v, out):
        assert t.stride(2) == 1 and t.stride(1) == head_dim and t.dtype == q.dtype, "rows of contiguous heads"
    assert rows % batch == 0 and k.shape[0] % batch == 0 and heads % kv_heads == 0 and out.shape == q.shape
    nq, nk = rows // batch, k.shape[0] // batch
    failed = _kernel("prefill_attention", q.dtype)(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), out.data_ptr(),
        out.stride(0), batch, nq, nk, heads, kv_heads, head_dim, scale, window or 0,
    )  # fmt: skip
    assert not failed, f"no prefill attention for head_dim {head_dim}"
    return out


def rms_norm(h: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`h += add` in place (when given), then RMSNorm(h) * weight as a new tensor. h, add: [rows, dim]
    contiguous."""
    out = torch.empty_like(h)
    rows, dim = h.shape
    assert h.is_contiguous() and (add is None or (add.is_contiguous() and add.shape == h.shape))
    ptr = None if add is None else add.data_ptr()
    _kernel("rms_norm", h.dtype)(h.data_ptr(), ptr, weight.data_ptr(), out.data_ptr(), rows, dim, eps)
    return out


def silu_mul(gate_up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """gate_up: [rows, 2 * dim] contiguous -> SiLU(gate) * up: [rows, dim]; with `gelu`, GELU's tanh
    approximation of gate (Gemma's) in SiLU's place."""
    rows, width = gate_up.shape
    assert gate_up.is_contiguous()
    out = gate_up.new_empty(rows, width // 2)
    _kernel("gelu_mul" if gelu else "silu_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
    return out


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """RoPE on q and k in place, then k and v into their cache slots.

    q: [n, heads, head_dim], k, v: [n, kv_heads, head_dim], each with rows of contiguous heads (views
    of the fused qkv output are); cos, sin: [n, 1, head_dim] contiguous, sin signed as apply_rope
    takes it; caches: [num_blocks, block_size, kv_heads, head_dim]."""
    n, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    for x in (q, k, v):
        assert x.stride(2) == 1 and x.stride(1) == head_dim, "heads of a row must be contiguous"
    assert cos.is_contiguous() and sin.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    _kernel("rope_write_kv", q.dtype)(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        n, heads, kv_heads, head_dim,
    )  # fmt: skip


@functools.cache
def _kernel(name: str, dtype: torch.dtype) -> Callable[..., Any]:
    dll = load()
    assert dll is not None, "call only where available()"
    fn: Callable[..., Any] = getattr(dll, f"{name}_{KERNEL_DTYPES[dtype]}")
    return fn
