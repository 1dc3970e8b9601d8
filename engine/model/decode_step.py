"""A decode step's decoder layers in one call to the CPU kernel library (decode_step.cpp).

`StageModel.forward` runs its layers module by module. On a thin, deep model at small batches the
kernels of a layer take less time than the Python around them (SmolLM2 at batch 1: 30 layers,
some ten module calls and ctypes calls each). For a micro-batch of decode tokens only, this runs
the same kernels in the same order from C++, so the result is bitwise the same: a request's
tokens do not depend on which path their micro-batch took.

It applies where every layer's norms, RoPE, attention and activation run on the library (float32
or bfloat16 on the CPU; Gemma 3's layers in float32, where its norms do: its norms around attention
and the MLP, GELU, and sliding layers with a RoPE table and a KV group of their own). A mixture of
experts (engine/model/moe.py) is called back as its whole module, its router torch's linear as in
the module loop: the step saves the Python around attention. A linear that runs one of the
library's GEMMs (ppserve's float or quantized GEMM) is called from C++ too; any other (oneDNN's,
which bfloat16's float linears run where the CPU lacks AVX-512 BF16) is called back here, as the
same module on the same input, in buffers this side owns.
`DecodeStep.build` says None where the step does not apply, and the layers run as modules.

The arguments cross into C++ as ctypes copies of decode_step.cpp's structs, which nothing in ctypes
compares with the C++ ones. The library therefore describes what it was built with (its
`decode_step_layout`: each struct's size and fields' offsets and types, the step's and its
callback's signatures), and `check_library` compares that with the copies here and the ctypes
signatures of the calls before a step is first built. A library that disagrees is not used: the
error names each struct, field or function that differs, and the layers run as modules (as
cpu_kernels.py runs torch ops where the library cannot be built).
"""

from __future__ import annotations

import _ctypes
import ctypes
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ppserve.engine.model import cpu_kernels
from ppserve.engine.model.attention import AttentionMetadata
from ppserve.engine.model.attention_backend import AttentionBackend
from ppserve.engine.model.attention_cpu import CpuDecodeAttention
from ppserve.engine.model.gguf_quant import GGUFLinear
from ppserve.engine.model.kernel_choice import ROWS, bucket
from ppserve.engine.model.linear import AnyLinear, Linear
from ppserve.engine.model.moe import MoE

if TYPE_CHECKING:
    from ppserve.engine.model.kv_cache import StageKvCache

log = logging.getLogger(__name__)


# What the step reads of a stage's decoder layers (engine/model/model.py's DecoderLayer and its
# modules), described here rather than imported: model.py builds the step, so this module stays
# below it and the two do not import each other.
class _Norm(Protocol):
    @property
    def weight(self) -> torch.Tensor: ...
    @property
    def eps(self) -> float: ...
    @property
    def fast(self) -> bool: ...
    def kernel_weight(self) -> torch.Tensor: ...


class _Attention(Protocol):
    qkv: AnyLinear
    out: AnyLinear
    backend: AttentionBackend  # the step runs the CPU kernels' decode attention
    rope: str  # its RoPE table: "global" or "local"
    window: int | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


class _Mlp(Protocol):
    gate_up: AnyLinear
    down: AnyLinear
    fast: bool
    gelu: bool


class FusedLayer(Protocol):
    """A stage's decoder layer after StageModel.fuse, as the step reads it."""

    @property
    def self_attn(self) -> _Attention: ...
    @property
    def mlp(self) -> _Mlp | MoE: ...
    @property
    def input_layernorm(self) -> _Norm: ...
    def norms(self) -> Sequence[_Norm | None]:
        """Its norms in decode_step.cpp's order: input, post-attention, q, k, pre- and post-MLP."""
        ...


# A GEMM's `kind` in decode_step.cpp, by the kernel's name in cpu_kernels.PackedGemm; the others
# are the caller's (kind 1), run through the callback.
_KINDS = {"float_gemm": 0, "float_gemm_silu": 2, "quant_gemm_q4": 4, "quant_gemm_q8": 8}
_CALLBACK = 1
_GGUF = 16  # + the number of parts: engine/model/gguf_quant.py's GGUFLinear


# The structs of decode_step.cpp, field for field (check_library holds them to the library's).
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
        ("pre_ffn_norm", ctypes.c_void_p),
        ("post_ffn_norm", ctypes.c_void_p),
        ("gelu", ctypes.c_int64),
        ("group", ctypes.c_int64),
        ("index", ctypes.c_int64),
        ("rope", ctypes.c_int64),
        ("moe", ctypes.c_int64),
    ]


class _Cache(ctypes.Structure):
    _fields_ = [
        ("kv", ctypes.c_void_p),
        ("slots", ctypes.c_int64),
        ("slot", ctypes.c_void_p),
        ("tables", ctypes.c_void_p),
        ("lens", ctypes.c_void_p),
        ("max_blocks", ctypes.c_int64),
    ]


class _Buffers(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("normed", "qkv", "attn", "proj", "gate_up", "act", "pending")]


class _Dims(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


# decode_step.cpp's structs by name: their mirrors above.
STRUCTS: dict[str, type[ctypes.Structure]] = {
    "Gemm": _Gemm,
    "Layer": _Layer,
    "Cache": _Cache,
    "Dims": _Dims,
    "Buffers": _Buffers,
}
_Field = tuple[str, int, str]  # name, offset, type (as decode_step.cpp's abi_type spells it)


class LayoutMismatch(RuntimeError):
    """The ctypes mirrors here disagree with the library built from decode_step.cpp: the two were
    edited apart, and a call would pass values to the wrong places."""


def _ctype(t: Any) -> str:
    """A ctypes type (None: void) as decode_step.cpp's abi_type spells the C type it stands for."""
    if t is None:
        return "v0"
    size = ctypes.sizeof(t)
    if issubclass(t, ctypes.Structure):
        return f"s{size}"
    if issubclass(t, (ctypes.c_void_p, ctypes.c_char_p, ctypes._Pointer, _ctypes.CFuncPtr)):
        return f"p{size}"
    if issubclass(t, (ctypes.c_float, ctypes.c_double)):
        return f"f{size}"
    code = getattr(t, "_type_", None)
    if isinstance(code, str) and len(code) == 1 and code in "bBhHiIlLqQ":
        return f"{'u' if code.isupper() else 'i'}{size}"
    return f"?{size}"


def _fields(struct: type[ctypes.Structure]) -> list[_Field]:
    """A Structure's fields in the order ctypes lays them out (a subclass's after its bases')."""
    fields = [f for cls in reversed(struct.__mro__) for f in vars(cls).get("_fields_", ())]
    return [(name, getattr(struct, name).offset, _ctype(ctype)) for name, ctype, *_ in fields]


def _parse(layout: str) -> tuple[dict[str, tuple[int, list[_Field]]], dict[str, list[str]]]:
    """decode_step_layout's text: the structs (size, fields) and the functions (result, arguments)."""
    structs: dict[str, tuple[int, list[_Field]]] = {}
    functions: dict[str, list[str]] = {}
    for line in layout.splitlines():
        kind, name, *rest = line.split()
        if kind == "struct":
            structs[name] = (int(rest[0]), [])
        elif kind == "field":
            structs[name][1].append((rest[0], int(rest[1]), rest[2]))
        elif kind == "function":
            functions[name] = rest
    return structs, functions


def _field(field: _Field | None) -> str:
    return "none" if field is None else f"`{field[0]}` at {field[1]} ({field[2]})"


def _struct_mismatches(name: str, size: int, fields: list[_Field], mirror: type[ctypes.Structure]) -> list[str]:
    """Where decode_step.cpp's struct `name` (its size and fields) and its mirror differ."""
    problems = []
    if ctypes.sizeof(mirror) != size:
        problems.append(f"struct {name}: {size} bytes in decode_step.cpp, {ctypes.sizeof(mirror)} in {mirror.__name__}")
    mirrored = _fields(mirror)
    for i in range(max(len(fields), len(mirrored))):
        c, py = (f[i] if i < len(f) else None for f in (fields, mirrored))
        if c != py:
            problems.append(
                f"struct {name}, field {i}: {_field(c)} in decode_step.cpp, {_field(py)} in {mirror.__name__}"
            )
    return problems


def mismatches(
    layout: str,
    structs: Mapping[str, type[ctypes.Structure]],
    functions: Mapping[str, tuple[Any, Sequence[Any] | None]],
) -> list[str]:
    """Where `layout` (decode_step.cpp's decode_step_layout) and the mirrors disagree: `structs`, by
    the C struct's name; `functions`, by name, the ctypes (restype, argtypes) the calls go through."""
    c_structs, c_functions = _parse(layout)
    problems = []
    for name in sorted(c_structs.keys() | structs.keys()):
        mirror = structs.get(name)
        if mirror is None or name not in c_structs:
            problems.append(f"struct {name}: " + ("no mirror here" if mirror is None else "not in decode_step.cpp"))
        else:
            problems += _struct_mismatches(name, *c_structs[name], mirror)
    for name in sorted(c_functions.keys() | functions.keys()):
        signature = ["not called here"]
        if name in functions:
            restype, argtypes = functions[name]
            signature = [_ctype(restype), *map(_ctype, argtypes or [])]
        c_signature = c_functions.get(name, ["not in decode_step.cpp"])
        if c_signature != signature:
            c, py = (" ".join(types) for types in (c_signature, signature))
            problems.append(f"function {name}: ({c}) in decode_step.cpp, ({py}) in its ctypes types")
    return problems


def check_library(
    dll: ctypes.CDLL,
    structs: Mapping[str, type[ctypes.Structure]] = STRUCTS,
    functions: Mapping[str, tuple[Any, Sequence[Any] | None]] | None = None,
) -> None:
    """Raises LayoutMismatch, naming every struct, field and function that differs, where the library
    (as decode_step.cpp was built into it) and the mirrors disagree. `functions` by default: the
    library's decode steps with the types cpu_kernels.py gave them, and the callback's (LINEAR_FN)."""
    if not hasattr(dll, "decode_step_layout"):
        raise LayoutMismatch(f"{dll._name} has no decode_step_layout: it was built from another decode_step.cpp")
    dll.decode_step_layout.argtypes, dll.decode_step_layout.restype = [], ctypes.c_char_p
    layout = dll.decode_step_layout().decode()
    if functions is None:
        steps = [getattr(dll, f"decode_layers_{s}") for s in cpu_kernels.KERNEL_DTYPES.values()]
        callback = cpu_kernels.LINEAR_FN
        functions = {fn.__name__: (fn.restype, fn.argtypes) for fn in steps}
        functions["LinearFn"] = (callback._restype_, callback._argtypes_)
    problems = mismatches(layout, structs, functions)
    if problems:
        raise LayoutMismatch("decode_step.py's ctypes mirrors disagree with decode_step.cpp: " + "; ".join(problems))


@functools.cache  # once per library loaded (cpu_kernels.configure may load another)
def _agrees(dll: ctypes.CDLL) -> bool:
    try:
        check_library(dll)
    except LayoutMismatch as e:
        log.error("%s. The decode step runs as modules instead", e)
        return False
    return True


def library_agrees() -> bool:
    """Whether the loaded library's decode step takes what this module passes (else it is not used)."""
    dll = cpu_kernels.load()
    return dll is not None and _agrees(dll)


def _gemm(linear: torch.nn.Module) -> _Gemm:
    """A `Linear` or `QuantLinear` (engine/model/linear.py, quantized.py) as decode_step.cpp takes it:
    one of the library's GEMMs, or else the caller's."""
    if isinstance(linear, GGUFLinear):  # its parts' weights, types and rows, as gguf_gemm.cpp takes them
        kind = _GGUF + len(linear.parts)
        bias = None if linear.bias is None else linear.bias.data_ptr()
        pointers = [ctypes.addressof(a) for a in (linear.weight_ptrs, linear.types, linear.part_rows)]
        return _Gemm(kind, *pointers, bias, linear.out_features, linear.in_features)
    packed = getattr(linear, "gemm", None)
    if not isinstance(packed, cpu_kernels.PackedGemm) or packed.kernel not in _KINDS:
        return _Gemm(_CALLBACK, None, None, None, None, linear.out_features, linear.in_features)
    *weights, bias = packed.pointers  # (weight, bias) or (weight, scales, mins, bias)
    weight, scales, mins = (*weights, None, None)[:3]
    return _Gemm(_KINDS[packed.kernel], weight, scales, mins, bias, packed.rows, linear.in_features)


def _linears(layer: FusedLayer) -> list[AnyLinear | MoE]:
    """A layer's linears in decode_step.cpp's order (LinearFn's `which`); a mixture of experts is
    one, in gate_up's place (`which` 2 runs the whole MoE module)."""
    mlp = layer.mlp
    if isinstance(mlp, MoE):
        return [layer.self_attn.qkv, layer.self_attn.out, mlp]
    return [layer.self_attn.qkv, layer.self_attn.out, mlp.gate_up, mlp.down]


def _mlp_gemms(mlp: _Mlp | MoE, hidden: int) -> list[_Gemm]:
    """A layer's gate_up and down as decode_step.cpp takes them; a mixture of experts' are the caller's
    (both stand for the whole module, hidden to hidden: its gate_up's buffers go unused)."""
    if isinstance(mlp, MoE):
        return [_Gemm(_CALLBACK, None, None, None, None, hidden, hidden) for _ in range(2)]
    return [_gemm(mlp.gate_up), _gemm(mlp.down)]


class DecodeStep:
    """The layers of one stage, as the library's decode step runs them."""

    def __init__(
        self,
        layers: Sequence[FusedLayer],
        structs: Sequence[_Layer],
        dims: _Dims,
        dtype: torch.dtype,
        keep: Sequence[torch.Tensor],
    ) -> None:
        fn = cpu_kernels.decode_layers(dtype)
        assert fn is not None
        self.fn = fn
        self.layers = (_Layer * len(structs))(*structs)
        self.dims = dims
        self.dtype = dtype
        self.keep = keep  # the norms' weights, alive as long as their pointers are
        self.where: tuple[tuple[bool, int], ...] | None = None  # the layers' caches as last set (_locate)
        # The linears the C++ side calls back for: (layer, which) -> forward, which as in LinearFn.
        self.linears = [[lin.forward for lin in _linears(layer)] for layer in layers]
        # The row counts (kernel_choice.bucket) at which every linear runs its one-row kernel: a
        # linear with a second kernel for more rows (engine/model/kernel_choice.py) runs it through
        # the modules.
        ours = [lin for layer in layers for lin in _linears(layer) if isinstance(lin, Linear)]
        self.buckets = frozenset(i for i in range(len(ROWS)) if all(lin.kernels[i] == lin.kernel for lin in ours))
        first = structs[0]
        self.widths = {
            "normed": dims.hidden,
            "qkv": first.qkv.out_features,
            "attn": dims.heads * dims.head_dim,
            "proj": dims.hidden,
            "gate_up": first.gate_up.out_features,
            "act": first.gate_up.out_features // 2,
            "pending": dims.hidden,
        }
        self._inputs: list[torch.Tensor] = []  # this step's input buffer per `which`
        self._outputs: list[torch.Tensor | None] = [None] * 4  # the last output per `which`, alive while used
        self._error: BaseException | None = None
        self.callback = cpu_kernels.LINEAR_FN(self._linear)  # kept: C++ holds its pointer during the call

    @classmethod
    def build(cls, layers: Sequence[FusedLayer]) -> DecodeStep | None:
        """From a stage's fused layers, or None where some layer's kernels are not all the library's
        (then the modules run)."""
        if not layers:
            return None
        dtype = layers[0].input_layernorm.weight.dtype
        if cpu_kernels.decode_layers(dtype) is None or not library_agrees():
            return None
        structs: list[_Layer] = []
        keep: list[torch.Tensor] = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            moe = isinstance(mlp, MoE)  # called back as its module (its router is torch's: moe.py)
            modules = layer.norms()
            on_kernels = isinstance(attn.backend, CpuDecodeAttention) and (moe or mlp.fast)
            if not on_kernels or any(n is not None and not n.fast for n in modules):
                return None  # (Gemma's norms run on the library in float32 only)
            norms = [None if n is None else n.kernel_weight() for n in modules]
            if any(n is not None and n.dtype != dtype for n in norms):
                return None
            if any(n is not None and n.eps != layer.input_layernorm.eps for n in modules):
                return None  # the step takes one eps for every norm
            hidden = layer.input_layernorm.weight.shape[0]
            gemms = [_gemm(attn.qkv), _gemm(attn.out), *_mlp_gemms(mlp, hidden)]
            keep += [n for n in norms if n is not None]
            pointers = [None if n is None else n.data_ptr() for n in norms]
            rope, gelu = int(attn.rope == "local"), 0 if isinstance(mlp, MoE) else int(mlp.gelu)
            structs.append(_Layer(*pointers[:4], *gemms, attn.window or 0, *pointers[4:], gelu, 0, 0, rope, int(moe)))
        if len({(s.qkv.out_features, s.gate_up.out_features) for s in structs}) > 1:
            return None  # one set of buffers serves every layer
        attn, norm = layers[0].self_attn, layers[0].input_layernorm
        dims = _Dims(norm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim, norm.eps, attn.scale)
        return cls(layers, structs, dims, dtype, keep)

    def applies(self, md: AttentionMetadata, rows: int) -> bool:
        """Whether a micro-batch of `rows` rows is decode tokens only, in row order (in each group),
        of a row count whose linears are those the step was built with (their one-row kernels)."""
        groups = (md,) if md.window is None else (md, md.window)
        if bucket(rows) not in self.buckets:
            return False
        return all(not g.prefills and g.decode is not None and g.decode.rows == slice(0, rows) for g in groups)

    def _locate(self, where: tuple[tuple[bool, int], ...]) -> None:
        """Each layer's cache: its group (1: the windowed layers') and place in it (StageKvCache.where)."""
        for layer, (windowed, index) in zip(self.layers, where, strict=True):
            layer.group, layer.index = int(windowed), index
        self.where = where

    def _linear(self, layer: int, which: int, rows: int) -> int:
        """decode_step.cpp's LinearFn: a linear that is not the library's, as its module runs it."""
        try:
            y = self.linears[layer][which](self._inputs[which]).contiguous()
            self._outputs[which] = y
            return y.data_ptr()
        except BaseException as e:  # raised again by __call__, after the C++ side has returned
            self._error = e
            return 0

    def __call__(
        self,
        h: torch.Tensor,
        ropes: dict[str, tuple[torch.Tensor, torch.Tensor]],
        kv_cache: StageKvCache,
        md: AttentionMetadata,
    ) -> None:
        """h: [n, hidden], the residual stream, updated in place to the stage's output; ropes: cos and
        sin ([n, 1, head_dim]) by kind ("global", "local"), as StageModel.forward makes them;
        kv_cache: the stage's, by group. Only where `applies`."""
        assert h.dtype == self.dtype and h.is_contiguous()
        if kv_cache.where != self.where:
            self._locate(kv_cache.where)
        alive: list[torch.Tensor] = []  # what the pointers below point into, alive for the call

        def cache(kv: torch.Tensor | None, g: AttentionMetadata | None) -> _Cache:
            if kv is None or g is None:
                return _Cache()  # a group no layer here reads
            d = g.decode
            assert d is not None and kv.is_contiguous()
            tensors = [d.block_tables.contiguous(), d.context_lens.contiguous(), g.slot_mapping.contiguous()]
            alive.extend(tensors)
            tables, lens, slots = (t.data_ptr() for t in tensors)
            return _Cache(kv.data_ptr(), kv.shape[2] * kv.shape[3], slots, tables, lens, d.block_tables.shape[1])

        caches = (_Cache * 2)(cache(kv_cache.full, md), cache(kv_cache.window, md.window))
        cos, sin = ropes.get("global") or ropes["local"]
        cos_local, sin_local = ropes.get("local", (cos, sin))
        assert all(t.is_contiguous() for t in (cos, sin, cos_local, sin_local))
        tables = (ctypes.c_void_p * 4)(*(t.data_ptr() for t in (cos, sin, cos_local, sin_local)))
        n = h.shape[0]
        buf = {name: h.new_empty(n, width) for name, width in self.widths.items()}
        self._inputs = [buf["normed"], buf["attn"], buf["normed"], buf["act"]]
        buffers = _Buffers(**{name: t.data_ptr() for name, t in buf.items()})
        self._error = None
        assert md.decode is not None
        failed = self.fn(
            ctypes.byref(self.layers), len(self.layers), ctypes.byref(self.dims), ctypes.byref(buffers), self.callback,
            h.data_ptr(), caches, tables, n, md.decode.block_size,
        )  # fmt: skip
        self._inputs, self._outputs = [], [None] * 4
        if failed:
            error, self._error = self._error, None
            raise RuntimeError("a linear of the decode step failed") from error
