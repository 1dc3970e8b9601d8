"""Write a Qwen3-MoE-shaped GGUF with random weights (llama.cpp's qwen3moe), once per machine.

The mixture-of-experts benchmark's model (benchmarks/moe.py): 24 layers, hidden 1024, 16 query
and 4 KV heads of 64 with q/k norms, 32 experts of intermediate 768 in every layer, 4 used per
token: 1.9B parameters in all, 0.3B of them active per token (with the head). Experts and
attention in Q4_0 (or --type Q8_0), the embedding and output too; norms and routers F32. The
vocabulary is benchmarks/make_big_gguf.py's (128256 tokens).

The blocks are random: each block's nibbles (Q4_0) or int8 values (Q8_0) uniform, its float16
scale set so that the weights have a standard deviation of about 0.02; routers normal with that
deviation, so that a token's expert scores differ and the routing spreads over the experts. The
file is written tensor by tensor, through a temporary name.

    .venv/bin/python -m benchmarks make-moe-gguf              # -> <cache>/models/moe-qwen3-1.9b-a0.3b-q4_0.gguf
    .venv/bin/python -m benchmarks make-moe-gguf --type Q8_0
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from benchmarks.make_big_gguf import VOCAB, add_vocabulary
from ppserve.engine.model.cache_dir import cache_dir

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 24, 1024, 16, 4, 64
EXPERTS, EXPERT_FFN, TOP_K = 32, 768, 4
DENSE_FFN = 3072  # the config's intermediate_size (every layer is experts; llama.cpp's converter writes it)
ROPE_BASE, CONTEXT, EPS = 1_000_000.0, 8192, 1e-6
STD = 0.02
FILE_TYPES = {Q.Q4_0: 2, Q.Q8_0: 7}  # general.file_type: llama.cpp's MOSTLY_Q4_0, MOSTLY_Q8_0
SEED = 9


def default_path(qtype: Q = Q.Q4_0) -> Path:
    return cache_dir() / "models" / f"moe-qwen3-1.9b-a0.3b-{qtype.name.lower()}.gguf"


def plan(qtype: Q) -> list[tuple[str, tuple[int, ...], Q]]:
    """Every tensor of the file in file order: (name, shape in torch order, type)."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out: list[tuple[str, tuple[int, ...], Q]] = [("token_embd.weight", (VOCAB, HIDDEN), qtype)]
    for i in range(LAYERS):
        b = f"blk.{i}"
        out += [
            (f"{b}.attn_norm.weight", (HIDDEN,), Q.F32),
            (f"{b}.attn_q.weight", (q, HIDDEN), qtype),
            (f"{b}.attn_k.weight", (kv, HIDDEN), qtype),
            (f"{b}.attn_v.weight", (kv, HIDDEN), qtype),
            (f"{b}.attn_output.weight", (HIDDEN, q), qtype),
            (f"{b}.attn_q_norm.weight", (HEAD_DIM,), Q.F32),
            (f"{b}.attn_k_norm.weight", (HEAD_DIM,), Q.F32),
            (f"{b}.ffn_norm.weight", (HIDDEN,), Q.F32),
            (f"{b}.ffn_gate_inp.weight", (EXPERTS, HIDDEN), Q.F32),
            (f"{b}.ffn_gate_exps.weight", (EXPERTS, EXPERT_FFN, HIDDEN), qtype),
            (f"{b}.ffn_up_exps.weight", (EXPERTS, EXPERT_FFN, HIDDEN), qtype),
            (f"{b}.ffn_down_exps.weight", (EXPERTS, HIDDEN, EXPERT_FFN), qtype),
        ]
    return [*out, ("output_norm.weight", (HIDDEN,), Q.F32), ("output.weight", (VOCAB, HIDDEN), qtype)]


def byte_shape(shape: tuple[int, ...], qtype: Q) -> tuple[int, ...]:
    if qtype == Q.F32:
        return shape
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return (*shape[:-1], shape[-1] // block * size)


def random_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...], qtype: Q) -> np.ndarray:
    """The tensor as the file holds it: norms ones, routers normal, matrices random blocks."""
    if qtype == Q.F32:
        if "ffn_gate_inp" in name:
            return rng.standard_normal(shape, dtype=np.float32) * STD
        return np.ones(shape, dtype=np.float32)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    count = int(np.prod(shape)) // block
    raw = rng.bit_generator.random_raw((count * size + 7) // 8).view(np.uint8)[: count * size]
    blocks = raw.reshape(count, size)
    # Uniform nibbles (q - 8) have a deviation of 4.61, uniform int8 values 73.9: d scales them to STD.
    d = STD / (4.61 if qtype == Q.Q4_0 else 73.9)
    blocks[:, 0:2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    return blocks.reshape(byte_shape(shape, qtype))


def add_metadata(writer: gguf.GGUFWriter, qtype: Q) -> None:
    a = "qwen3moe"
    writer.add_string("general.name", "moe-qwen3-random")
    writer.add_uint32("general.file_type", FILE_TYPES[qtype])
    writer.add_uint32("general.quantization_version", 2)
    for key, value in {
        "block_count": LAYERS,
        "context_length": CONTEXT,
        "embedding_length": HIDDEN,
        "feed_forward_length": DENSE_FFN,
        "expert_feed_forward_length": EXPERT_FFN,
        "expert_count": EXPERTS,
        "expert_used_count": TOP_K,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS,
        "attention.key_length": HEAD_DIM,
        "attention.value_length": HEAD_DIM,
    }.items():
        writer.add_uint32(f"{a}.{key}", value)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", EPS)
    writer.add_float32(f"{a}.rope.freq_base", ROPE_BASE)
    add_vocabulary(writer, pre="qwen2")


def write(path: Path, qtype: Q = Q.Q4_0, seed: int = SEED) -> Path:
    """Write the file at `path` (through a temporary name beside it); returns `path`."""
    tensors = plan(qtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, "qwen3moe")
    try:
        add_metadata(writer, qtype)
        for name, shape, kind in tensors:  # the table first: shapes and types are all the header needs
            raw = byte_shape(shape, kind)
            if kind == Q.F32:
                writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
            else:
                writer.add_tensor_info(name, raw, np.dtype(np.uint8), int(np.prod(raw)), raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        rng = np.random.default_rng(seed)
        for name, shape, kind in tensors:
            writer.write_tensor_data(random_tensor(rng, name, shape, kind))
            if name.endswith("ffn_down_exps.weight"):
                print(f"  {name}", file=sys.stderr, flush=True)
        writer.close()
        os.replace(tmp, path)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--type", choices=[q.name for q in FILE_TYPES], default="Q4_0")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    qtype = Q[args.type]
    path = args.out or default_path(qtype)
    if path.exists():
        print(f"{path} exists")
        return
    write(path, qtype)
    print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB)")
