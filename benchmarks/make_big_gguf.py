"""Write a Llama-3-8B-shaped GGUF with random weights, as a Q4_K_M-style file, once per machine.

The test model for serving a model bigger than one node (benchmarks/big_model.py): 32 layers,
hidden 4096, intermediate 14336, 32 query and 8 KV heads of 128, a vocabulary of 128256, RoPE
base 500000, an output matrix of its own. The types follow llama.cpp's Q4_K_M mix: Q4_K for most
matrices and the embedding; Q6_K for the output, and for attn_v and ffn_down in the layers where
llama.cpp's `use_more_bits` picks them (the first and last eighth, every third between: half of
them); norms F32. About 4.9 GB.

The blocks are random (nibbles, 6-bit sub-scales, Q6_K's bits), with the float16 block scales
`d` (and Q4_K's `dmin`) chosen so that the dequantized weights have a standard deviation of
about 0.02 and a mean of about 0: activations then stay finite through the 32 layers, as
`--check` shows. The vocabulary is a small byte-level BPE (the 256 byte tokens and the merges of
a few words), padded with unreachable tokens to 128256 and ending in Llama 3's 256 special tokens,
which transformers converts and the engine's checks accept.

The file is written tensor by tensor (gguf-py's `add_tensor_info`, then `write_tensor_data` for
each in turn), so the generator never holds more than one tensor; it goes to a temporary name and
is renamed when whole.

    .venv/bin/python -m benchmarks make-big-gguf         # -> <cache>/models/big-llama-8b-q4_k_m.gguf
    .venv/bin/python -m benchmarks make-big-gguf --check  # and then a few tokens through every layer
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf.quants import dequantize

from ppserve.engine.model.cache_dir import cache_dir

FILE_NAME = "big-llama-8b-q4_k_m.gguf"
LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 32, 4096, 14336, 32, 8, 128, 128256
ROPE_BASE, CONTEXT = 500000.0, 8192
TARGET_STD = 0.02
SEED = 8
Q4_K_M = 15  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M (general.file_type)
FIRST_SPECIAL = 128000  # Llama 3's special tokens fill the last 256 ids
BOS, EOS, EOT = FIRST_SPECIAL, FIRST_SPECIAL + 1, FIRST_SPECIAL + 9
_WORDS = "the and to of in is that it for on with as this was be are at by from pipeline stage model token".split()
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def default_path() -> Path:
    return cache_dir() / "models" / FILE_NAME


@dataclass(frozen=True)
class Planned:
    name: str  # the GGUF's name
    shape: tuple[int, ...]  # torch order: [out_features, in_features] for a matrix
    qtype: Q


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the Q4_K_M layers whose attn_v and ffn_down get Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def plan(layers: int = LAYERS) -> list[Planned]:
    """Every tensor of the file, in file order."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out = [Planned("token_embd.weight", (VOCAB, HIDDEN), Q.Q4_K)]
    for i in range(layers):
        more = Q.Q6_K if use_more_bits(i, layers) else Q.Q4_K
        out += [
            Planned(f"blk.{i}.attn_norm.weight", (HIDDEN,), Q.F32),
            Planned(f"blk.{i}.attn_q.weight", (q, HIDDEN), Q.Q4_K),
            Planned(f"blk.{i}.attn_k.weight", (kv, HIDDEN), Q.Q4_K),
            Planned(f"blk.{i}.attn_v.weight", (kv, HIDDEN), more),
            Planned(f"blk.{i}.attn_output.weight", (HIDDEN, q), Q.Q4_K),
            Planned(f"blk.{i}.ffn_norm.weight", (HIDDEN,), Q.F32),
            Planned(f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN), Q.Q4_K),
            Planned(f"blk.{i}.ffn_up.weight", (FFN, HIDDEN), Q.Q4_K),
            Planned(f"blk.{i}.ffn_down.weight", (HIDDEN, FFN), more),
        ]
    return [*out, Planned("output_norm.weight", (HIDDEN,), Q.F32), Planned("output.weight", (VOCAB, HIDDEN), Q.Q6_K)]


def nbytes(t: Planned) -> int:
    if t.qtype == Q.F32:
        return 4 * int(np.prod(t.shape))
    block, size = gguf.GGML_QUANT_SIZES[t.qtype]
    return t.shape[0] * (t.shape[1] // block) * size


def _random_blocks(rng: np.random.Generator, qtype: Q, count: int, d: float) -> np.ndarray:
    """`count` random blocks of `qtype` ([count, block bytes] uint8) with block scale `d`."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    words = (count * size + 7) // 8
    raw = rng.bit_generator.random_raw(words).view(np.uint8)[: count * size]  # faster than rng.bytes
    blocks = raw.reshape(count, size)
    if qtype == Q.Q4_K:  # d, dmin (float16), 12 bytes of 6-bit scales and mins, 128 of nibbles
        blocks[:, 0:2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
        blocks[:, 2:4] = np.frombuffer(np.float16(7.5 * d).tobytes(), np.uint8)
        # Each sub-block's min equal to its (random) scale, with dmin = 7.5 d: its weights are
        # d * scale * (nibble - 7.5), centred on 0 as a real quantizer's are. The 12 bytes of
        # scales (from byte 4): 0-3 the first four scales (and the top bits of the last four),
        # 4-7 the mins likewise, 8-11 the last four's low bits (scale low nibble, min high nibble).
        blocks[:, 8:12] = blocks[:, 4:8]
        blocks[:, 12:16] = (blocks[:, 12:16] & 0x0F) * 0x11
    elif qtype == Q.Q6_K:  # ql (128), qh (64), 16 int8 sub-scales, d (float16)
        # Sub-scales in [-16, 15]: small enough that d stays a normal float16 (not a subnormal).
        scales = (blocks[:, 192:208] & 0x1F).astype(np.int16) - 16
        blocks[:, 192:208] = scales.astype(np.int8).view(np.uint8)
        blocks[:, 208:210] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    else:
        raise ValueError(f"no random blocks for {qtype.name}")
    return blocks


def block_scale(qtype: Q, target_std: float = TARGET_STD) -> float:
    """The `d` whose random blocks dequantize to weights of standard deviation `target_std`:
    measured on blocks with d = 1 (the weights are linear in d), not derived by hand."""
    sample = _random_blocks(np.random.default_rng(0), qtype, 4096, 1.0)
    values = dequantize(sample, qtype)
    return float(target_std / values.std())


def random_tensor(rng: np.random.Generator, t: Planned, d: float) -> np.ndarray:
    """The tensor's bytes as the file holds them: [rows, row bytes] for a quantized matrix."""
    if t.qtype == Q.F32:
        return np.ones(t.shape, dtype=np.float32)  # norms: the identity scale
    rows, cols = t.shape
    block = gguf.GGML_QUANT_SIZES[t.qtype][0]
    return _random_blocks(rng, t.qtype, rows * (cols // block), d).reshape(rows, -1)


def vocabulary() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): byte-level BPE tokens and merges for a few words, padding, and
    the 256 special tokens at the end."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled = {b: chr(b) for b in printable}
    spelled.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in spelled)})
    tokens = [spelled[b] for b in range(256)]
    known, merges = set(tokens), []
    for word in _WORDS:
        left = "Ġ"  # GPT-2's spelling of a leading space
        for ch in word:
            if left + ch not in known:
                merges.append(f"{left} {ch}")
                tokens.append(left + ch)
                known.add(left + ch)
            left += ch
    tokens += [f"<unused{i}>" for i in range(FIRST_SPECIAL - len(tokens))]  # normal, never produced
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>"]
    specials += ["<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>"]
    specials += ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    specials += [f"<|reserved_special_token_{i}|>" for i in range(2, VOCAB - FIRST_SPECIAL - len(specials) + 2)]
    tokens += specials
    assert len(tokens) == VOCAB and tokens[EOT] == "<|eot_id|>", (len(tokens), tokens[EOT])
    types = [1] * FIRST_SPECIAL + [3] * (VOCAB - FIRST_SPECIAL)  # normal, then control
    return tokens, types, merges


def add_metadata(writer: gguf.GGUFWriter, layers: int) -> None:
    a = "llama"
    writer.add_string("general.name", "big-llama-8b-random")
    writer.add_uint32("general.file_type", Q4_K_M)
    writer.add_uint32("general.quantization_version", 2)
    for key, value in {
        "block_count": layers,
        "context_length": CONTEXT,
        "embedding_length": HIDDEN,
        "feed_forward_length": FFN,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS,
        "attention.key_length": HEAD_DIM,
        "attention.value_length": HEAD_DIM,
        "rope.dimension_count": HEAD_DIM,
        "vocab_size": VOCAB,
    }.items():
        writer.add_uint32(f"{a}.{key}", value)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32(f"{a}.rope.freq_base", ROPE_BASE)
    add_vocabulary(writer)


def add_vocabulary(writer: gguf.GGUFWriter, pre: str | None = None) -> None:
    """The tokenizer's keys: `vocabulary()`, its special ids and the chat template (`pre`: the
    pre-tokenizer llama.cpp names, where the file says one)."""
    tokens, types, merges = vocabulary()
    writer.add_string("tokenizer.ggml.model", "gpt2")
    if pre is not None:
        writer.add_string("tokenizer.ggml.pre", pre)
    writer.add_key_value("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING)
    writer.add_key_value("tokenizer.ggml.token_type", types, V.ARRAY, V.INT32)
    writer.add_key_value("tokenizer.ggml.merges", merges, V.ARRAY, V.STRING)
    writer.add_uint32("tokenizer.ggml.bos_token_id", BOS)
    writer.add_uint32("tokenizer.ggml.eos_token_id", EOS)
    writer.add_uint32("tokenizer.ggml.eot_token_id", EOT)
    writer.add_string("tokenizer.chat_template", CHAT_TEMPLATE)


def write(path: Path, layers: int = LAYERS, seed: int = SEED) -> Path:
    """Write the file at `path` (through a temporary name beside it); returns `path`."""
    tensors = plan(layers)
    scales: dict[Q, float] = {q: block_scale(q) for q in {t.qtype for t in tensors} if q != Q.F32}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, "llama")
    try:
        add_metadata(writer, layers)
        for t in tensors:  # the table first: shapes and types are all the header needs
            if t.qtype == Q.F32:
                writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), nbytes(t))
            else:
                block, size = gguf.GGML_QUANT_SIZES[t.qtype]
                byte_shape = (t.shape[0], t.shape[1] // block * size)
                writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), nbytes(t), raw_dtype=t.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        rng = np.random.default_rng(seed)
        for i, t in enumerate(tensors):
            data = random_tensor(rng, t, scales.get(t.qtype, 0.0))
            writer.write_tensor_data(data)
            del data  # one tensor at a time
            if t.name.endswith("ffn_down.weight") or i == len(tensors) - 1:
                print(f"  {t.name}", file=sys.stderr, flush=True)
        writer.close()
        os.replace(tmp, path)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return path


def check(path: Path, num_tokens: int = 8) -> None:
    """The engine prepares the file (its header, vocabulary and tokenizer checks), then a few
    tokens go through every layer in float32, each matrix dequantized by gguf-py a slice of rows at
    a time (the memory of one slice, not of the model); fails unless every activation is finite."""
    import torch
    import torch.nn.functional as F

    from ppserve.engine.config import EngineConfig

    start = time.perf_counter()
    config = EngineConfig.create(path, kv_cache_gb=0.05)
    mc = config.model_config
    print(f"engine: {mc.num_layers} layers, hidden {mc.hidden_size}, vocab {mc.vocab_size} ({config.model})")
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    layers = sum(name.endswith("attn_q.weight") for name in tensors)

    def floats(name: str, rows: slice | list[int] = slice(None)) -> torch.Tensor:
        t = tensors[name]
        return torch.from_numpy(np.array(dequantize(np.asarray(t.data[rows]), t.tensor_type), dtype=np.float32))

    def linear(x: torch.Tensor, name: str, step: int = 4096) -> torch.Tensor:
        rows = tensors[name].data.shape[0]
        return torch.cat([x @ floats(name, slice(r, r + step)).T for r in range(0, rows, step)], dim=-1)

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * floats(name)

    ids = [BOS, *range(300, 300 + num_tokens - 1)]
    n = len(ids)
    x = floats("token_embd.weight", ids)  # [n, hidden]
    inv_freq = 1.0 / ROPE_BASE ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    angles = torch.arange(n).float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]

    def rope(t: torch.Tensor) -> torch.Tensor:  # [n, heads, head_dim]
        half = t.shape[-1] // 2
        return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

    stds = []
    for i in range(layers):
        h = norm(x, f"blk.{i}.attn_norm.weight")
        q = rope(linear(h, f"blk.{i}.attn_q.weight").view(n, HEADS, HEAD_DIM)).transpose(0, 1)
        k = rope(linear(h, f"blk.{i}.attn_k.weight").view(n, KV_HEADS, HEAD_DIM)).transpose(0, 1)
        v = linear(h, f"blk.{i}.attn_v.weight").view(n, KV_HEADS, HEAD_DIM).transpose(0, 1)
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=0) for t in (k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(n, -1)
        x = x + linear(attn, f"blk.{i}.attn_output.weight")
        h = norm(x, f"blk.{i}.ffn_norm.weight")
        gate, up = linear(h, f"blk.{i}.ffn_gate.weight"), linear(h, f"blk.{i}.ffn_up.weight")
        x = x + linear(F.silu(gate) * up, f"blk.{i}.ffn_down.weight")
        stds.append(float(x.std()))
        if not torch.isfinite(x).all():
            raise SystemExit(f"check: the activations after layer {i} are not finite")
    logits = linear(norm(x, "output_norm.weight"), "output.weight")
    if not torch.isfinite(logits).all():
        raise SystemExit("check: the logits are not finite")
    shown = ", ".join(f"{s:.2f}" for s in stds[:: max(1, layers // 8)])
    print(f"check: {n} tokens through {layers} layers in {time.perf_counter() - start:.0f} s: residual std {shown}")
    print(f"check: logits std {float(logits.std()):.2f}, greedy next tokens {logits.argmax(-1).tolist()}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help=f"where (default <cache>/models/{FILE_NAME})")
    parser.add_argument("--layers", type=int, default=LAYERS, help="fewer layers, for a quick try")
    parser.add_argument("--force", action="store_true", help="write it again even if it is there")
    parser.add_argument("--check", action="store_true", help="then run a few tokens through every layer")
    args = parser.parse_args(argv)
    path = args.out or default_path()
    if args.force or not path.is_file():
        start = time.perf_counter()
        print(f"writing {path} ({sum(nbytes(t) for t in plan(args.layers)) / 1e9:.2f} GB)", file=sys.stderr)
        write(path, args.layers)
        print(f"wrote {path}: {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s")
    else:
        print(f"{path} is there ({path.stat().st_size / 1e9:.2f} GB); --force writes it again")
    if args.check:
        check(path)
