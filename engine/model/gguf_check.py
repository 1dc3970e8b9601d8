"""What a GGUF file must say for ppserve to serve its model, checked on its header
(engine/model/gguf_header.py) before anything is built from it: the prepared config, the tokenizer
conversion, the tensor table.

A file is input: each metadata value the engine uses must have the right type and a sane range
(counts positive, heads dividing as attention needs, epsilons and bases finite and positive), each
token id must lie in the vocabulary, the merges must be pairs of its tokens, and each tensor must be
one the model has (no layer at or past block_count), with the shape the metadata implies. The
vocabulary's size is tied to the file by the embedding's shape, whose bytes the header check
placed inside the file.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, NoReturn

from ppserve.engine.model.gguf_header import (
    FLOAT_TYPES,
    INTEGER_TYPES,
    MAX_ARRAY_ITEMS,
    STRING,
    TYPE_NAMES,
    GGUFArray,
    GGUFError,
    GGUFHeader,
    GGUFValue,
)
from ppserve.engine.model.model_config import MAX_EXPERTS, MAX_LAYERS, MAX_SIZE

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
MIXTRAL = "MixtralForCausalLM"  # llama.cpp's `llama` with experts
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# A mixture of experts' layer (llama.cpp's qwen3moe, and llama with experts: Mixtral): the router,
# and each projection of every expert in one 3-D tensor [experts, out, in], which the tensor table
# cuts into one entry per expert (engine names `mlp.experts.E.gate_proj` and so on).
MOE_LAYER_NAMES = {k: v for k, v in LAYER_NAMES.items() if not k.startswith("ffn_") or k == "ffn_norm"} | {
    "ffn_gate_inp": "mlp.gate"
}
EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# Gemma 3 norms attention's and the MLP's outputs too, and its `ffn_norm` is the one before the MLP
# (gguf-py's tensor map for MODEL_ARCH.GEMMA3).
GEMMA3_LAYER_NAMES = LAYER_NAMES | {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# What llama.cpp assumes for Gemma 3 where the file says nothing (llama-model.cpp): every 6th layer
# global, the sliding layers' RoPE base 10000. transformers' GGUF loader takes the same defaults.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
TOKENS, MERGES = "tokenizer.ggml.tokens", "tokenizer.ggml.merges"
KEPT_ARRAYS = (TOKENS, MERGES)  # the string arrays the checks read element by element
MAX_DIM = MAX_SIZE  # the caps of a config.json, which the prepared checkpoint becomes
# A vocabulary without merges gets them derived by transformers (sentencepiece files): one per
# token and split point whose halves are tokens too, each split a copy of the token. Its time and
# memory grow with their number and with the sum of the tokens' squared lengths; both are bounded
# as an explicit merges array is (published vocabularies stay far below).
MAX_VOCAB_WORK = 1 << 26
MAX_DERIVED_MERGES = MAX_ARRAY_ITEMS


@dataclass(frozen=True)
class GGUFModel:
    """The checked values the prepared checkpoint is written from."""

    arch: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    rms_eps: float
    rope_base: float
    rope_linear_factor: float | None  # None: no rope scaling
    vocab: int
    file_type: int
    eos_ids: tuple[int, ...]  # the end-of-sequence and end-of-turn tokens the file names
    # Gemma 3 only: the sliding layers' window and RoPE base, which layers are global (every
    # `sliding_pattern`-th), and the attention's query_pre_attn_scalar.
    sliding_window: int | None = None
    rope_local_base: float | None = None
    sliding_pattern: int | None = None
    query_pre_attn_scalar: int | None = None  # an integer in Gemma3TextConfig, which checks its types
    # A mixture of experts: experts per layer, used per token, and each expert's MLP width (0: dense).
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0

    @property
    def architecture(self) -> str:
        """transformers' class of the model (llama with experts is Mixtral)."""
        return MIXTRAL if self.arch == "llama" and self.experts else ARCHITECTURES[self.arch]

    def moe_config(self) -> dict[str, Any]:
        """config.json's fields of the experts, as transformers writes them; llama.cpp renormalises
        the top k weights of both families (llama-model.cpp: build_moe_ffn's norm_w)."""
        fields: dict[str, Any] = {"num_experts_per_tok": self.experts_used, "num_local_experts": self.experts}
        if self.arch == "qwen3moe":
            fields |= {"moe_intermediate_size": self.expert_ffn, "norm_topk_prob": True, "decoder_sparse_step": 1}
        else:
            fields |= {"intermediate_size": self.expert_ffn, "sliding_window": None}
        return fields

    def gemma3_config(self) -> dict[str, Any]:
        """config.json's Gemma 3 fields, as transformers' Gemma3TextConfig writes them: RoPE per
        layer type (a linear scaling on the global layers only, as llama.cpp applies it)."""
        assert self.sliding_pattern is not None and self.rope_local_base is not None
        full: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_base}
        if self.rope_linear_factor is not None:
            full |= {"rope_type": "linear", "factor": self.rope_linear_factor}
        pattern = self.sliding_pattern
        return {
            "model_type": "gemma3_text",
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "sliding_window": self.sliding_window,
            "layer_types": ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(self.layers)],
            "rope_parameters": {
                "full_attention": full,
                "sliding_attention": {"rope_type": "default", "rope_theta": self.rope_local_base},
            },
        }

    def required_tensors(self) -> list[str]:
        qk_norm = self.arch in ("qwen3", "gemma3", "qwen3moe")
        names = layer_names(self.arch, self.experts > 0)
        kinds = [k for k in names if qk_norm or k not in ("attn_q_norm", "attn_k_norm")]
        kinds += list(EXPERT_NAMES) if self.experts else []
        layers = (f"blk.{i}.{k}.weight" for i in range(self.layers) for k in kinds)
        return ["token_embd.weight", "output_norm.weight", *layers]


def layer_names(arch: str, experts: bool = False) -> dict[str, str]:
    """A layer's GGUF tensor kinds -> the engine's module names, for the family `arch` (`experts`:
    with a mixture of experts in place of the MLP; their 3-D tensors are EXPERT_NAMES')."""
    if experts:
        return MOE_LAYER_NAMES
    return GEMMA3_LAYER_NAMES if arch == "gemma3" else LAYER_NAMES


def engine_name(gguf_name: str, arch: str = "llama", experts: bool = False) -> str | None:
    """The engine's name of a tensor; for an expert tensor, the name of its experts with `*` for
    the expert's index."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = LAYER_TENSOR.fullmatch(gguf_name)
    names = layer_names(arch, experts)
    if m and m[2] in names:
        return f"model.layers.{m[1]}.{names[m[2]]}.{m[3]}"
    if m and experts and m[2] in EXPERT_NAMES and m[3] == "weight":
        return f"model.layers.{m[1]}.mlp.experts.*.{EXPERT_NAMES[m[2]]}.weight"
    return None


def norm_shift(arch: str, name: str) -> float:
    """What llama.cpp's converter added to the tensor `name` (an engine name): Gemma's RMSNorm
    scales by (1 + w), llama.cpp's by its weight, so the converter stores w + 1 for every norm;
    the reader subtracts it again (as transformers' GGUF loader does), and the model adds it back
    in float32."""
    return 1.0 if arch == "gemma3" and name.endswith("norm.weight") else 0.0


def check_model(header: GGUFHeader) -> GGUFModel:
    """The model the header describes, every value the engine takes from it checked; GGUFError
    (a ConfigError) naming the file, the field and the problem otherwise."""
    fields = _Fields(header)
    arch = fields.string("general.architecture")
    if arch not in ARCHITECTURES:
        fields.fail(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    if "tokenizer.ggml.model" not in header.fields or TOKENS not in header.fields:
        fields.fail("the GGUF has no tokenizer (tokenizer.ggml.model and tokens)")
    if fields.integer("split.count", 1, low=0) > 1:
        raise GGUFError(
            f"{header.file} is one part of a split GGUF; merge the parts first (llama.cpp's gguf-split --merge)"
        )
    heads = fields.integer(f"{arch}.attention.head_count", high=MAX_DIM)
    kv_heads = fields.integer(f"{arch}.attention.head_count_kv", heads, high=heads)
    if heads % kv_heads:
        fields.fail(f"{arch}.attention.head_count {heads} is not a multiple of head_count_kv {kv_heads}")
    hidden = fields.integer(f"{arch}.embedding_length", high=MAX_DIM)
    head_dim = fields.integer(f"{arch}.attention.key_length", max(hidden // heads, 1), high=MAX_DIM)
    if fields.integer(f"{arch}.attention.value_length", head_dim, high=MAX_DIM) != head_dim:
        fields.fail("attention key and value lengths differ; not supported")
    if fields.integer(f"{arch}.rope.dimension_count", head_dim, high=MAX_DIM) != head_dim:
        fields.fail(f"partial rotary embeddings ({arch}.rope.dimension_count) are not supported")
    if head_dim % 2:
        fields.fail(f"the attention head size {head_dim} must be even (rotary embeddings turn pairs)")
    scaling = fields.string(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        fields.fail(f"rope scaling {scaling!r} is not supported (only linear)")
    vocab = _check_vocabulary(fields, arch)
    layers = _block_count(fields, arch, header)
    model = GGUFModel(
        arch=arch,
        layers=layers,
        hidden=hidden,
        ffn=fields.integer(f"{arch}.feed_forward_length", high=MAX_DIM),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        context=fields.integer(f"{arch}.context_length", high=MAX_DIM),
        rms_eps=fields.positive_float(f"{arch}.attention.layer_norm_rms_epsilon"),
        rope_base=fields.positive_float(f"{arch}.rope.freq_base", 10000.0),
        rope_linear_factor=fields.positive_float(f"{arch}.rope.scaling.factor") if scaling == "linear" else None,
        vocab=vocab,
        file_type=fields.integer("general.file_type", 0, low=0),
        eos_ids=tuple(
            fields.integer(k, high=vocab - 1, low=0)
            for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
            if k in header.fields
        )
        + _end_of_turn(fields, arch),
        **(_gemma3_fields(fields, layers, hidden, heads, head_dim) if arch == "gemma3" else {}),
        **_moe_fields(fields, arch),
    )
    _check_tensors(fields, model)
    return model


def _moe_fields(fields: _Fields, arch: str) -> dict[str, Any]:
    """A mixture of experts' counts and width (qwen3moe has them always, llama where it is Mixtral);
    what llama.cpp can compute on top of the plain softmax top-k (shared experts, another gating
    function, a scale of the weights) is refused."""
    experts = fields.integer(f"{arch}.expert_count", 0, low=0, high=MAX_EXPERTS)
    if arch == "qwen3moe" and not experts:
        fields.fail("qwen3moe.expert_count is missing or 0 (a mixture of experts has experts)")
    if not experts:
        return {}
    if arch not in ("llama", "qwen3moe"):
        fields.fail(f"{arch}.expert_count: experts are supported in llama (Mixtral) and qwen3moe models only")
    for key, default in (("expert_shared_count", 0), ("expert_gating_func", 1)):
        value = fields.integer(f"{arch}.{key}", default, low=0)
        if value != default:
            fields.fail(f"{arch}.{key} {value} is not supported (only {default}: softmax over experts, none shared)")
    if fields.positive_float(f"{arch}.expert_weights_scale", 1.0) != 1.0:
        fields.fail(f"{arch}.expert_weights_scale is not supported (only 1)")
    used = fields.integer(f"{arch}.expert_used_count", high=experts)
    width = f"{arch}.expert_feed_forward_length" if arch == "qwen3moe" else f"{arch}.feed_forward_length"
    return {"experts": experts, "experts_used": used, "expert_ffn": fields.integer(width, high=MAX_DIM)}


def _end_of_turn(fields: _Fields, arch: str) -> tuple[int, ...]:
    """Gemma's chat turns end with <end_of_turn>, which its files seldom name as their EOT token;
    llama.cpp finds it by its text, and so does this (a reply then stops there, not at EOS)."""
    tokens = fields.header.fields[TOKENS].value
    if arch != "gemma3" or not isinstance(tokens, GGUFArray) or not isinstance(tokens.items, list):
        return ()
    return (tokens.items.index("<end_of_turn>"),) if "<end_of_turn>" in tokens.items else ()


def _gemma3_fields(fields: _Fields, layers: int, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """Gemma 3's values, as llama.cpp reads them (llama-model.cpp): the window is required, the
    pattern and the local base are llama.cpp's constants unless the file states them."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if f"gemma3.{key}" in fields.header.fields:
            fields.fail(f"GGUF metadata key 'gemma3.{key}' is not supported (Gemma 3 has no softcapping)")
    # llama.cpp scales the 27B model's (62 layers) queries by hidden / heads, every other size's by
    # head_dim: the query_pre_attn_scalar of their config.json files (168 and 256).
    return {
        "sliding_window": fields.integer("gemma3.attention.sliding_window"),
        "rope_local_base": fields.positive_float("gemma3.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE),
        "sliding_pattern": fields.integer("gemma3.attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN),
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
    }


class _Fields:
    """Typed, range-checked reads of a header's metadata."""

    def __init__(self, header: GGUFHeader) -> None:
        self.header = header

    def fail(self, problem: str) -> NoReturn:
        raise GGUFError(f"{self.header.file}: {problem}")

    def get(self, key: str, kinds: frozenset[int], what: str) -> GGUFValue | None:
        field = self.header.fields.get(key)
        if field is not None and field.type not in kinds:
            got = TYPE_NAMES.get(field.type, str(field.type))
            if isinstance(field.value, GGUFArray):
                got = f"an array of {field.value.count} {TYPE_NAMES.get(field.value.item_type)} (per-layer values?)"
            self.fail(f"GGUF metadata key {key!r} must be {what}, not {got}")
        return field

    def present(self, key: str, kinds: frozenset[int], what: str) -> GGUFValue:
        field = self.get(key, kinds, what)
        if field is None:
            raise GGUFError(f"{self.header.file}: GGUF metadata key {key!r} is missing")
        return field

    def string(self, key: str, default: str | None = None) -> str:
        field = self.get(key, frozenset({STRING}), "a string")
        if field is None and default is not None:
            return default
        return str(self.present(key, frozenset({STRING}), "a string").value)

    def integer(self, key: str, default: int | None = None, *, low: int = 1, high: int = MAX_DIM) -> int:
        field = self.get(key, INTEGER_TYPES, "an integer")
        if field is None and default is not None:
            return default
        value = int(self.present(key, INTEGER_TYPES, "an integer").value)  # type: ignore[arg-type]
        if not low <= value <= high:
            self.fail(f"GGUF metadata key {key!r} is {value}; it must be in [{low}, {high}]")
        return value

    def positive_float(self, key: str, default: float | None = None) -> float:
        field = self.get(key, FLOAT_TYPES | INTEGER_TYPES, "a number")
        if field is None and default is not None:
            return default
        value = float(self.present(key, FLOAT_TYPES | INTEGER_TYPES, "a number").value)  # type: ignore[arg-type]
        if not (math.isfinite(value) and value > 0):
            self.fail(f"GGUF metadata key {key!r} is {value}; it must be a finite number > 0")
        return value

    def array(self, key: str, kinds: frozenset[int], what: str, count: int) -> GGUFArray | None:
        field = self.header.fields.get(key)
        if field is None:
            return None
        value = field.value
        if not isinstance(value, GGUFArray) or value.item_type not in kinds:
            self.fail(f"GGUF metadata key {key!r} must be an array of {what}")
        if value.count != count:
            self.fail(f"GGUF metadata key {key!r} has {value.count} entries for {count} tokens")
        return value


def _check_vocabulary(fields: _Fields, arch: str) -> int:
    """The number of tokens, after checking the vocabulary's arrays and token ids against it."""
    field = fields.header.fields[TOKENS]
    tokens = field.value
    if not isinstance(tokens, GGUFArray) or tokens.item_type != STRING or not isinstance(tokens.items, list):
        fields.fail(f"GGUF metadata key {TOKENS!r} must be an array of strings")
    vocab = tokens.count
    if vocab == 0:
        fields.fail(f"the vocabulary ({TOKENS}) is empty")
    if MERGES not in fields.header.fields:
        _check_derivable(fields, tokens.items)
    fields.array("tokenizer.ggml.token_type", INTEGER_TYPES, "integers", vocab)
    fields.array("tokenizer.ggml.scores", FLOAT_TYPES, "numbers", vocab)
    if (size := fields.integer(f"{arch}.vocab_size", vocab, low=0)) != vocab:
        fields.fail(f"{arch}.vocab_size is {size}, but {TOKENS} has {vocab} tokens")
    for key in fields.header.fields:
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            fields.integer(key, low=0, high=vocab - 1)  # a token id inside the vocabulary
    merges = fields.header.fields.get(MERGES)
    if merges is not None:
        _check_merges(fields, merges.value, set(tokens.items))
    return vocab


def _check_derivable(fields: _Fields, tokens: list[str]) -> None:
    """Merges derived from the vocabulary stay within the bounds of an explicit merges array."""
    work = sum(len(t) ** 2 for t in tokens)  # first: it bounds the count's own work below
    if work > MAX_VOCAB_WORK:
        fields.fail(
            f"the vocabulary has no merges and its tokens are too long to derive them from "
            f"(sum of squared lengths {work} > {MAX_VOCAB_WORK})"
        )
    vocab, derived = set(tokens), 0
    for token in tokens:
        derived += sum(token[:i] in vocab and token[i:] in vocab for i in range(1, len(token)))
        if derived > MAX_DERIVED_MERGES:
            fields.fail(f"the vocabulary has no merges and would derive more than {MAX_DERIVED_MERGES} of them")


def _check_merges(fields: _Fields, merges: object, vocab: set[str]) -> None:
    """Each merge is two tokens separated by one space, whose concatenation is a token too: what
    the BPE model built from them requires (it aborts the process otherwise)."""
    if not isinstance(merges, GGUFArray) or merges.item_type != STRING or not isinstance(merges.items, list):
        fields.fail(f"GGUF metadata key {MERGES!r} must be an array of strings")
    for i, merge in enumerate(merges.items):
        parts = merge.split(" ")
        if len(parts) != 2 or not all(parts):
            fields.fail(f"{MERGES} entry {i} ({_quote(merge)}) is not two tokens separated by one space")
        for token in (*parts, "".join(parts)):
            if token not in vocab:
                fields.fail(f"{MERGES} entry {i} ({_quote(merge)}) uses {_quote(token)}, which is not a token")


def _block_count(fields: _Fields, arch: str, header: GGUFHeader) -> int:
    """block_count, bounded by the tensors the file holds before any per-layer list is built."""
    per_layer = 9  # the fewest tensors a layer has: two norms, q, k, v, o, gate, up, down
    layers = fields.integer(f"{arch}.block_count", high=MAX_LAYERS)
    if layers * per_layer > len(header.tensors):
        fields.fail(
            f"{arch}.block_count is {layers}, but the file's {len(header.tensors)} tensors "
            f"make at most {len(header.tensors) // per_layer} layers"
        )
    return layers


def _check_tensors(fields: _Fields, model: GGUFModel) -> None:
    """Every tensor known, of a layer below block_count, with the shape the metadata implies;
    every tensor the model needs present."""
    header = fields.header
    for t in header.tensors:
        if engine_name(t.name, model.arch, model.experts > 0) is None:
            fields.fail(f"tensor {t.name!r} is not supported (unknown to the {model.arch} model)")
        m = LAYER_TENSOR.fullmatch(t.name)
        if m and int(m[1]) >= model.layers:
            fields.fail(f"tensor {t.name!r} is for layer {m[1]}, but {model.arch}.block_count is {model.layers}")
    names = {t.name for t in header.tensors}
    if missing := [n for n in model.required_tensors() if n not in names]:
        raise GGUFError(f"{header.file} is missing tensor(s): {', '.join(missing[:5])}")
    expected = _weight_shapes(model)
    for t in header.tensors:
        m = LAYER_TENSOR.fullmatch(t.name)
        kind, suffix = (m[2], m[3]) if m else t.name.split(".")
        want = expected[kind] if suffix == "weight" else expected[kind][:1]  # a bias: one per output row
        if kind == "token_embd" and t.shape[1:] == [model.hidden] and t.shape[0] != model.vocab:
            fields.fail(f"token_embd.weight has {t.shape[0]} rows, but {TOKENS} has {model.vocab} tokens")
        if t.shape != list(want):
            fields.fail(f"tensor {t.name!r} has shape {t.shape}; the metadata implies {list(want)}")


def _weight_shapes(m: GGUFModel) -> dict[str, tuple[int, ...]]:
    """Each tensor kind's weight shape in torch order: [out_features, in_features] for linears."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return {
        "token_embd": (m.vocab, m.hidden),
        "output": (m.vocab, m.hidden),
        "output_norm": (m.hidden,),
        "attn_norm": (m.hidden,),
        "ffn_norm": (m.hidden,),
        "post_attention_norm": (m.hidden,),
        "post_ffw_norm": (m.hidden,),
        "attn_q": (q, m.hidden),
        "attn_k": (kv, m.hidden),
        "attn_v": (kv, m.hidden),
        "attn_output": (m.hidden, q),
        "attn_q_norm": (m.head_dim,),
        "attn_k_norm": (m.head_dim,),
        "ffn_gate": (m.ffn, m.hidden),
        "ffn_up": (m.ffn, m.hidden),
        "ffn_down": (m.hidden, m.ffn),
        "ffn_gate_inp": (m.experts, m.hidden),
        "ffn_gate_exps": (m.experts, m.expert_ffn, m.hidden),
        "ffn_up_exps": (m.experts, m.expert_ffn, m.hidden),
        "ffn_down_exps": (m.experts, m.hidden, m.expert_ffn),
    }


def _quote(text: str, limit: int = 60) -> str:
    """`text` quoted for a message, at most about `limit` characters of it."""
    return repr(text if len(text) <= limit else text[:limit] + "...")
