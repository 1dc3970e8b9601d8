"""Tiny GGUF files for the hostile-input tests, written with gguf-py's GGUFWriter from scratch (no
checkpoint to train or convert): a small Llama or Qwen3 with a byte-level BPE vocabulary that
transformers converts, any metadata key replaced, dropped or added, and the byte positions of the
header's fields, to patch them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n"]


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, the base of a byte-level BPE vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in spelled)
    spelled.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return [spelled[b] for b in range(256)]


TOKENS = [*SPECIALS, *byte_alphabet(), *("".join(m.split(" ")) for m in MERGES)]


@dataclass(frozen=True)
class Tiny:
    """A tiny model's GGUF: every matrix row whole Q8_0 blocks, q/k norms for qwen3."""

    arch: str = "llama"
    layers: int = 2
    hidden: int = 32
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 64
    qtype: Q = Q.F32
    seed: int = 0


def metadata(spec: Tiny, tokens: list[str] = TOKENS, merges: list[str] = MERGES) -> dict[str, tuple[Any, V]]:
    a = spec.arch
    head_dim = spec.hidden // spec.heads
    return {
        f"{a}.block_count": (spec.layers, V.UINT32),
        f"{a}.context_length": (256, V.UINT32),
        f"{a}.embedding_length": (spec.hidden, V.UINT32),
        f"{a}.feed_forward_length": (spec.ffn, V.UINT32),
        f"{a}.attention.head_count": (spec.heads, V.UINT32),
        f"{a}.attention.head_count_kv": (spec.kv_heads, V.UINT32),
        f"{a}.attention.key_length": (head_dim, V.UINT32),
        f"{a}.attention.value_length": (head_dim, V.UINT32),
        f"{a}.attention.layer_norm_rms_epsilon": (1e-5, V.FLOAT32),
        f"{a}.rope.freq_base": (10000.0, V.FLOAT32),
        "tokenizer.ggml.model": ("gpt2", V.STRING),
        "tokenizer.ggml.tokens": (tokens, V.ARRAY),
        "tokenizer.ggml.token_type": ([3 if t in SPECIALS else 1 for t in tokens], V.ARRAY),
        "tokenizer.ggml.merges": (merges, V.ARRAY),
        "tokenizer.ggml.bos_token_id": (1, V.UINT32),
        "tokenizer.ggml.eos_token_id": (2, V.UINT32),
        "tokenizer.chat_template": ("{% for m in messages %}{{ m['content'] }}{% endfor %}", V.STRING),
    }


def tensors(spec: Tiny, vocab: int = len(TOKENS)) -> dict[str, np.ndarray]:
    """name -> values in torch order ([out_features, in_features] for a linear)."""
    rng = np.random.default_rng(spec.seed)
    head_dim = spec.hidden // spec.heads
    q, kv, h = spec.heads * head_dim, spec.kv_heads * head_dim, spec.hidden
    out = {"token_embd.weight": (vocab, h), "output.weight": (vocab, h)}
    for i in range(spec.layers):
        shapes = {"attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q)}
        shapes |= {"ffn_gate": (spec.ffn, h), "ffn_up": (spec.ffn, h), "ffn_down": (h, spec.ffn)}
        out |= {f"blk.{i}.{k}.weight": s for k, s in shapes.items()}
    values = {name: (rng.standard_normal(s) * 0.1).astype(np.float32) for name, s in out.items()}
    norms = ["output_norm", *(f"blk.{i}.{k}" for i in range(spec.layers) for k in ("attn_norm", "ffn_norm"))]
    values |= {f"{n}.weight": np.ones(h, np.float32) for n in norms}
    if spec.arch == "qwen3":
        values |= {
            f"blk.{i}.attn_{x}_norm.weight": np.ones(head_dim, np.float32) for i in range(spec.layers) for x in "qk"
        }
    return values


def write_tiny(
    path: Path,
    spec: Tiny = Tiny(),
    *,
    meta: dict[str, tuple[Any, V]] | None = None,
    drop: tuple[str, ...] = (),
    weights: dict[str, np.ndarray] | None = None,
) -> Path:
    """The tiny model's GGUF at `path`; `meta` replaces or adds metadata, `drop` removes keys,
    `weights` replaces or adds tensors (values in torch order)."""
    writer = gguf.GGUFWriter(path, spec.arch)
    for key, (value, vtype) in (metadata(spec) | (meta or {})).items():
        if key not in drop:
            sub = None
            if vtype == V.ARRAY:
                first = value[0]
                sub = V.STRING if isinstance(first, str) else V.FLOAT32 if isinstance(first, float) else V.INT32
            writer.add_key_value(key, value, vtype, sub)
    for name, values in (tensors(spec) | (weights or {})).items():
        if spec.qtype != Q.F32 and values.ndim == 2:
            raw = gguf.quants.quantize(values, spec.qtype)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=spec.qtype)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def slots(path: Path) -> dict[str, int]:
    """Byte positions of the header's fields, where gguf-py's reader finds them in a valid file:
    `type:<key>`, `value:<key>`, `count:<key>` (an array's length), `length:<key>` (a string's); per tensor
    `ndims:`, `dim0:`, `type:`, `offset:` + its name; plus the header's own counts."""
    reader = gguf.GGUFReader(path)
    out = {"version": 4, "tensor_count": 8, "kv_count": 16}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.offset + 8 + len(key.encode()) + 4
        out[f"type:{key}"], out[f"value:{key}"] = value - 4, value
        if field.types[0] == V.ARRAY:
            out[f"count:{key}"] = value + 4
        elif field.types[0] == V.STRING:
            out[f"length:{key}"] = value
    for t in reader.tensors:
        ndims = t.field.offset + 8 + len(t.name.encode())
        out |= {f"ndims:{t.name}": ndims, f"dim0:{t.name}": ndims + 4}
        out[f"type:{t.name}"] = ndims + 4 + 8 * len(t.shape)
        out[f"offset:{t.name}"] = ndims + 4 + 8 * len(t.shape) + 4
    return out


def patch(path: Path, pos: int, value: int, width: int = 8) -> None:
    with path.open("r+b") as f:
        f.seek(pos)
        f.write((value % (1 << (8 * width))).to_bytes(width, "little"))


def read_u64(path: Path, pos: int) -> int:
    with path.open("rb") as f:
        f.seek(pos)
        return int.from_bytes(f.read(8), "little")
