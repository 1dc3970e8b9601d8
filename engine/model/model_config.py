"""The model's shape and math, read from a Hugging Face `config.json` and checked once.

Anything in the config that would change the math and that we do not implement is an error here,
at load time, rather than silently wrong output later. The file is input: every dimension must be a
positive integer and every epsilon, base and factor a finite positive number (JSON parsers accept
NaN and Infinity), so that nothing is sized or computed from a value that cannot be right.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)
GEMMA3 = "Gemma3ForCausalLM"
QWEN3_MOE, MIXTRAL = "Qwen3MoeForCausalLM", "MixtralForCausalLM"
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Far above any published model; they keep a corrupt config from sizing anything absurd.
MAX_SIZE = 1 << 24  # a vocabulary, hidden or head size, head count, context length
MAX_LAYERS = 1 << 12
MAX_EXPERTS = 1 << 12  # a layer's (DeepSeek-V3 has 256)


class ConfigError(ValueError):
    """A checkpoint or engine setting we cannot serve correctly."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclass(frozen=True)
class MoeConfig:
    """A mixture of experts in place of some layers' MLP (engine/model/moe.py), as transformers'
    Qwen3-MoE and Mixtral compute it."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each expert's MLP
    norm_topk_prob: bool  # the top k probabilities renormalised to sum to 1
    # The weights of the experts' outputs in the hidden dtype (Qwen3-MoE), else in float32 (Mixtral).
    weights_in_hidden_dtype: bool
    sparse_layers: tuple[bool, ...]  # per layer: experts, or the dense MLP of `intermediate_size`


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    # Per layer: None for full attention, else the window w (a query at p sees keys in (p - w, p]).
    sliding_windows: tuple[int | None, ...]
    dtype: str  # the checkpoint's own dtype name, e.g. "bfloat16"
    eos_token_ids: tuple[int, ...]
    # generation_config.json's `max_new_tokens`: how many tokens a request that names no limit gets.
    max_new_tokens: int | None = None
    # Gemma 3's differences from the Llama family (the defaults are the Llama family's math).
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_pytorch_tanh"
    query_pre_attn_scalar: float | None = None  # attention scores scale by its ** -0.5; None: head_dim's
    rope_local: RopeConfig | None = None  # RoPE of the sliding-window layers; None: `rope` on every layer
    # Gemma's layer: RMSNorm scales by (1 + w) in float32, attention and MLP outputs are normed too
    # (before the residual add), and the embedding is multiplied by sqrt(hidden_size).
    gemma_norms: bool = False
    moe: MoeConfig | None = None  # Qwen3-MoE's and Mixtral's experts

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json in {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        gen_path = Path(model_dir) / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_dict(raw, gen)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {arch or '(none)'!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            _positive_int(raw, key)
        gemma = arch == GEMMA3
        if gemma:
            _check_gemma3(raw)
        else:
            act = raw.get("hidden_act", "silu")
            if act not in ("silu", "swish"):  # the same function under two names
                raise ConfigError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
        if raw.get("quantization_config"):
            raise ConfigError("config.json: quantized checkpoints (quantization_config) are not supported")
        num_heads = raw["num_attention_heads"]
        num_kv_heads = _positive_int(raw, "num_key_value_heads", num_heads)  # absent (or null): one per head
        if num_heads % num_kv_heads:
            raise ConfigError(
                f"config.json: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            )
        # Qwen3's and Gemma 3's config classes default head_dim to 128 and 256, the others derive it.
        derived = {"Qwen3ForCausalLM": 128, QWEN3_MOE: 128, GEMMA3: 256}.get(arch, raw["hidden_size"] // num_heads)
        head_dim = _positive_int(raw, "head_dim", derived)
        if head_dim < 1:
            raise ConfigError(f"config.json: hidden_size {raw['hidden_size']} is smaller than num_attention_heads")
        rope, rope_local = _parse_gemma3_rope(raw, head_dim) if gemma else (_parse_rope(raw, head_dim), None)
        num_layers = raw["num_hidden_layers"]
        bias = bool(raw.get("attention_bias", False))
        # Which projections carry a bias differs per family (as in transformers' modeling files).
        no_bias = ("MistralForCausalLM", MIXTRAL)
        qkv_bias = False if arch in no_bias else {"LlamaForCausalLM": bias, "Qwen2ForCausalLM": True}.get(arch, bias)
        o_bias = bias if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", QWEN3_MOE, GEMMA3) else False
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_positive_float(raw, "rms_norm_eps", 1e-6),
            max_position_embeddings=_positive_int(raw, "max_position_embeddings", 131072 if gemma else 4096),
            rope=rope,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),  # Gemma 3's class ties by default
            qkv_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
            qk_norm=arch in ("Qwen3ForCausalLM", QWEN3_MOE, GEMMA3),
            sliding_windows=_parse_sliding_windows(raw, arch, num_layers),
            dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            eos_token_ids=_parse_eos(raw, generation or {}, raw["vocab_size"]),
            max_new_tokens=_parse_max_new_tokens(generation or {}),
            hidden_act="gelu_pytorch_tanh" if gemma else "silu",
            query_pre_attn_scalar=_positive_float(raw, "query_pre_attn_scalar", 256.0) if gemma else None,
            rope_local=rope_local,
            gemma_norms=gemma,
            moe=_parse_moe(raw, arch, num_layers),
        )


def _check_gemma3(raw: dict[str, Any]) -> None:
    """What transformers' Gemma 3 can compute and ppserve does not: refused rather than ignored."""
    act = raw.get("hidden_activation", "gelu_pytorch_tanh")  # Gemma3TextConfig reads this key, not hidden_act
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"config.json: hidden_activation {_shown(act)} is not supported (only 'gelu_pytorch_tanh')")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(key) is not None:
            raise ConfigError(f"config.json: {key} is not supported (only null)")
    if raw.get("use_bidirectional_attention"):
        raise ConfigError("config.json: use_bidirectional_attention is not supported (a causal model only)")


def _parse_rope(raw: dict[str, Any], head_dim: int) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); older files write `rope_theta` + `rope_scaling`.
    if raw.get("rope_parameters") and raw.get("rope_scaling") and raw["rope_parameters"] != raw["rope_scaling"]:
        raise ConfigError("config.json has both rope_parameters and rope_scaling, and they differ; keep one")
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = _positive_float(params if "rope_theta" in params else raw, "rope_theta", 10000.0)
    return _rope(params, theta, raw, head_dim)


def _parse_gemma3_rope(raw: dict[str, Any], head_dim: int) -> tuple[RopeConfig, RopeConfig]:
    """(global, local) RoPE of Gemma 3, as Gemma3TextConfig resolves them: transformers 5 writes
    `rope_parameters` keyed by layer type; older files write `rope_theta` and `rope_scaling` (which
    apply to the full-attention layers only) and `rope_local_base_freq` (the sliding ones')."""
    nested, scaling = raw.get("rope_parameters") or {}, raw.get("rope_scaling") or {}
    kinds = ("full_attention", "sliding_attention")
    if not isinstance(nested, dict) or not set(nested) <= set(kinds) or not isinstance(scaling, dict):
        raise ConfigError(f"config.json: Gemma 3's rope_parameters must be keyed by layer type ({', '.join(kinds)})")
    if not all(isinstance(nested.get(kind) or {}, dict) for kind in kinds):
        raise ConfigError("config.json: each of Gemma 3's rope_parameters must be an object")
    full, local = ({"rope_type": "default", **(nested.get(kind) or {})} for kind in kinds)
    full.update(scaling)
    if full.get("type", full["rope_type"]) != full["rope_type"]:  # transformers would keep rope_type
        raise ConfigError(f"config.json: rope type {full['type']!r} and rope_type {full['rope_type']!r} differ")
    full_theta = _positive_float(full if "rope_theta" in full else raw, "rope_theta", 1_000_000.0)
    if "rope_theta" in local:
        local_theta = _positive_float(local, "rope_theta")
    else:
        local_theta = _positive_float(raw, "rope_local_base_freq", 10_000.0)
    return _rope(full, full_theta, raw, head_dim), _rope(local, local_theta, raw, head_dim)


def _rope(params: dict[str, Any], theta: float, raw: dict[str, Any], head_dim: int) -> RopeConfig:
    """One RoPE from its parameters (rope_type, factor, ...) and base `theta`."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"config.json: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ConfigError(f"config.json: partial_rotary_factor {partial} is not supported (only 1.0)")
    if head_dim % 2:
        raise ConfigError(f"config.json: head_dim {head_dim} must be even for RoPE")
    factor = 1.0  # unused by the default type, whatever the file says
    if rope_type != "default":
        given = params.get("factor", 1.0)
        if not _is_positive_number(given):
            raise ConfigError(f"config.json: rope factor must be positive, got {_shown(given)}")
        factor = float(given)
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in params:
                raise ConfigError(f"config.json: llama3 rope scaling needs {key!r}")
        low, high = _positive_float(params, "low_freq_factor"), _positive_float(params, "high_freq_factor")
        if high <= low:
            raise ConfigError("config.json: llama3 rope scaling needs high_freq_factor > low_freq_factor")
        return RopeConfig(
            theta=theta,
            rope_type=rope_type,
            factor=factor,
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=_positive_int(params, "original_max_position_embeddings"),
        )
    return RopeConfig(theta=theta, rope_type=rope_type, factor=factor if rope_type == "linear" else 1.0)


def _parse_moe(raw: dict[str, Any], arch: str, num_layers: int) -> MoeConfig | None:
    """The experts of Qwen3-MoE and Mixtral, with their config classes' defaults; None for the others."""
    if arch not in (QWEN3_MOE, MIXTRAL):
        return None
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts, Mixtral's own name.
    experts = _positive_int(raw, "num_local_experts" if "num_local_experts" in raw else "num_experts", 8)
    if experts > MAX_EXPERTS:
        raise ConfigError(f"config.json: {experts} experts a layer is more than ppserve takes ({MAX_EXPERTS})")
    top_k = _positive_int(raw, "num_experts_per_tok", 2)
    if top_k > experts:
        raise ConfigError(f"config.json: num_experts_per_tok {top_k} is more than the {experts} experts")
    if arch == MIXTRAL:  # every layer's MLP is experts, their weights renormalised, in float32
        return MoeConfig(experts, top_k, raw["intermediate_size"], True, False, (True,) * num_layers)
    step = _positive_int(raw, "decoder_sparse_step", 1)
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and 0 <= i < num_layers for i in dense):
        raise ConfigError(f"config.json: mlp_only_layers must be a list of layer indices, got {_shown(dense)}")
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    norm = raw.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ConfigError(f"config.json: norm_topk_prob must be true or false, got {_shown(norm)}")
    return MoeConfig(experts, top_k, _positive_int(raw, "moe_intermediate_size", 768), norm, True, sparse)


def _parse_sliding_windows(raw: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, ...]:
    if arch == "LlamaForCausalLM":
        return (None,) * num_layers
    if arch in (QWEN3_MOE, MIXTRAL):  # one window for every layer, or none (their config classes' default)
        window = raw.get("sliding_window") if arch == MIXTRAL or raw.get("use_sliding_window") else None
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ConfigError(f"config.json: sliding_window must be a positive integer or null, got {window!r}")
        return (window,) * num_layers
    # Defaults as in transformers' config classes (4096; Qwen uses it only on sliding layers).
    window = raw.get("sliding_window", 4096)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ConfigError(f"config.json: sliding_window must be a positive integer or null, got {window!r}")
    if arch == "MistralForCausalLM":
        return (window,) * num_layers  # Mistral applies its window to every layer
    # Qwen: transformers 5 lists each layer's kind in layer_types (derived from use_sliding_window).
    layer_types = raw.get("layer_types")
    if layer_types is None and arch == GEMMA3:
        # Gemma3TextConfig's default: every `sliding_window_pattern`-th layer global, the others sliding.
        pattern = _positive_int(raw, "sliding_window_pattern", 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if layer_types is None:
        if not raw.get("use_sliding_window", False):
            return (None,) * num_layers
        first_sliding = int(raw.get("max_window_layers", 28))
        layer_types = ["full_attention" if i < first_sliding else "sliding_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ConfigError(f"config.json: layer_types has {len(layer_types)} entries for {num_layers} layers")
    windows: list[int | None] = []
    for kind in layer_types:
        if kind == "full_attention":
            windows.append(None)
        elif kind == "sliding_attention" and isinstance(window, int) and window > 0:
            windows.append(window)
        else:
            raise ConfigError(f"config.json: layer type {kind!r} (sliding_window={window!r}) is not supported")
    return tuple(windows)


def _parse_max_new_tokens(generation: dict[str, Any]) -> int | None:
    value = generation.get("max_new_tokens")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"generation_config.json: max_new_tokens must be a positive integer, got {value!r}")
    return value


def _parse_eos(raw: dict[str, Any], generation: dict[str, Any], vocab_size: int) -> tuple[int, ...]:
    # generation_config.json is what generation uses; config.json is the fallback.
    eos = generation.get("eos_token_id", raw.get("eos_token_id"))
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ConfigError(f"eos_token_id {_shown(token)} is not a token id (0 to {vocab_size - 1})")
    # An id past the vocabulary can never be sampled: it ends nothing, and is dropped (lists of
    # ids, as Llama 3 writes them, may name ids that a smaller vocabulary lacks).
    return tuple(t for t in ids if t < vocab_size)


def _positive_int(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    """raw[key], an integer in [1, its cap]; `default` where it is absent or null (None: required)."""
    value = raw.get(key)
    if value is None and default is not None:
        return default
    cap = MAX_LAYERS if key == "num_hidden_layers" else MAX_SIZE
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= cap:
        raise ConfigError(f"config.json: {key} must be a positive integer (at most {cap}), got {_shown(value)}")
    return value


def _positive_float(raw: dict[str, Any], key: str, default: float | None = None) -> float:
    """raw[key], a finite number > 0; `default` where it is absent or null (None: required)."""
    value = raw.get(key)
    if value is None and default is not None:
        return default
    if not _is_positive_number(value):
        raise ConfigError(f"config.json: {key} must be a finite number > 0, got {_shown(value)}")
    return float(value)


def _is_positive_number(value: object) -> TypeGuard[int | float]:
    # NaN compares false, and so do infinity and an integer too large for a float.
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= sys.float_info.max


def _shown(value: object) -> str:
    """A value for a message: a config is input, so at most a line of it."""
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."
