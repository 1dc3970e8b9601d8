"""Writing GGUF files for tests with gguf-py's GGUFWriter: a tiny Hugging Face checkpoint converted
the way llama.cpp's converter does it (names, the q/k row permutation for Llama, the vocabulary),
with its matrices in a chosen GGML type."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType
from safetensors.numpy import load_file

from ppserve.engine.model.gguf_quant import BLOCKS, random_blocks

ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
ARCHS |= {"Qwen3MoeForCausalLM": "qwen3moe", "MixtralForCausalLM": "llama"}  # Mixtral: llama with experts
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_GLOBAL["lm_head.weight"] = "output.weight"
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # a mixture's router
    "block_sparse_moe.gate": "ffn_gate_inp",  # Mixtral's
}
# An expert's projection (Qwen3-MoE's name, Mixtral's) -> the 3-D tensor of all a layer's experts.
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERTS = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps", "w3": "ffn_up_exps"}
_EXPERTS |= {"down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, *module, kind = hf_name.split(".")
    return f"blk.{layer}.{_LAYER['.'.join(module)]}.{kind}"


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama's q and k rows (its RoPE rotates adjacent pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantized(values: np.ndarray, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """`values` in `qtype` as raw bytes. gguf-py cannot quantize to the K types: those get random
    blocks whose float16 scales are set to small finite values (the test compares dequantization,
    not quantization)."""
    try:
        return gguf.quants.quantize(values, qtype)
    except NotImplementedError:
        pass
    if qtype.name in BLOCKS:  # weights of about the size the model's were
        return random_blocks(qtype.name, values.shape, np.random.default_rng(seed), std=float(values.std()))
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    raw = np.random.default_rng(seed).integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    if qtype == GGMLQuantizationType.Q6_K:  # ql, qh, int8 scales, then d
        raw[..., -2:] = scale
    else:  # Q4_K, Q5_K, Q2_K, Q3_K-like: d and dmin first
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    return raw.reshape(rows, cols // block * size)


def write_gguf(
    model_dir: Path,
    out: Path,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    *,
    tokenizer: bool = True,
    arch: str | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    mix: dict[str, GGMLQuantizationType] | None = None,
) -> Path:
    """`mix`: the type of the matrices whose GGUF name contains a key (as llama.cpp's Q4_K_M keeps
    attn_v and ffn_down in Q6_K); the others are `qtype`."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = arch or ARCHS[config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(out, arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    experts = config.get("num_local_experts") or config.get("num_experts") or 0
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if tokenizer:
        _add_tokenizer(writer, model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    stacks: dict[str, dict[int, np.ndarray]] = {}  # each layer's experts' projections, as llama.cpp stacks them
    for name in list(tensors):
        if m := _EXPERT.fullmatch(name):
            stacks.setdefault(f"blk.{m[1]}.{_EXPERTS[m[3]]}.weight", {})[int(m[2])] = tensors.pop(name)
    for name, parts in stacks.items():
        values = np.stack([parts[e] for e in range(experts)]).astype(np.float32)
        kind = next((t for key, t in (mix or {}).items() if key in name), qtype)
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        else:
            raw = quantized(values.reshape(-1, values.shape[-1]), kind, seed=len(name))
            writer.add_tensor(name, raw, raw_shape=(experts, values.shape[1], raw.shape[-1]), raw_dtype=kind)
    for name, values in sorted(tensors.items()):
        values = values.astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            values = llama_permute(values, heads)
        elif arch == "llama" and ".k_proj." in name:
            values = llama_permute(values, kv_heads)
        # norms, biases and routers stay F32
        kind = qtype if values.ndim == 2 and "ffn_gate_inp" not in gguf_name(name) else GGMLQuantizationType.F32
        kind = next((t for key, t in (mix or {}).items() if key in gguf_name(name) and values.ndim == 2), kind)
        if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F64):
            writer.add_tensor(
                gguf_name(name), values.astype(np.float64 if kind == GGMLQuantizationType.F64 else np.float32)
            )
        else:
            raw = quantized(values, kind, seed=len(name))
            writer.add_tensor(gguf_name(name), raw, raw_shape=raw.shape, raw_dtype=kind)
    for name, values in (extra_tensors or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tokenizer(writer: gguf.GGUFWriter, model_dir: Path) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab.update(special)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    merges = tok["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    writer.add_bos_token_id(vocab[config["bos_token"]])
    writer.add_eos_token_id(vocab[config["eos_token"]])
    template = config.get("chat_template") or (model_dir / "chat_template.jinja").read_text()
    writer.add_chat_template(template)
