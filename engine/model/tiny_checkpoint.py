"""Small random checkpoints in Hugging Face format, for tests, benchmarks and the demo.

Weights come from `transformers` itself (seeded), so a checkpoint is exactly what a real one looks
like on disk: config.json, model.safetensors (or shards + index), generation_config.json,
tokenizer.json and tokenizer_config.json with a chat template. The tokenizer is a byte-level BPE
trained in well under a second on text generated here, so nothing is downloaded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = [PAD, BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>"]

_WORDS = (
    "the a pipeline stage token model layer serve fast slow request batch cache block prefill decode "
    "chunk bubble stream queue engine tensor head attention kernel river mountain city light music "
    "garden winter summer ocean story number quiet bright small large early late every some"
).split()
_EXTRA = ["café", "naïve", "Zürich", "東京", "日本語", "🙂", "🚀", "ü", "é", "—", "…", "->", "{}", "\n"]


@dataclass(frozen=True)
class TinySpec:
    arch: str = "llama"
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 512
    tie_word_embeddings: bool = False
    seed: int = 0
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rope_scaling: str = "none"  # none | linear | llama3
    sliding_window: int | None = None  # mistral and gemma3 (its sliding layers)
    dtype: str = "float32"
    max_shard_size: str | None = None  # e.g. "200KB" to write several shards
    init_std: float = 0.1  # larger than transformers' 0.02 so logits are well separated
    overrides: tuple[tuple[str, object], ...] = ()  # extra config.json fields, e.g. (("attention_bias", True),)
    max_new_tokens: int | None = None  # written to generation_config.json when set


def corpus(seed: int, sentences: int = 2000) -> list[str]:
    """Deterministic text with multi-byte characters, so the BPE learns merges across them."""
    rng = random.Random(seed)
    lines = []
    for _ in range(sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), rng.choice(_EXTRA))
        lines.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ","]))
    return lines


def train_tokenizer(vocab_size: int, seed: int):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
    )


def make_tiny_checkpoint(out_dir: str | Path, spec: TinySpec = TinySpec()) -> Path:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    if spec.arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {spec.arch!r}")
    if spec.vocab_size < 300:
        raise ValueError("vocab_size must be >= 300 (256 byte tokens plus merges and special tokens)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(spec.vocab_size, spec.seed)
    rope: dict[str, object] = {"rope_type": "default", "rope_theta": 10000.0}
    if spec.rope_scaling == "linear":
        rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    elif spec.rope_scaling == "llama3":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        }
    elif spec.rope_scaling != "none":
        raise ValueError(f"rope_scaling must be none, linear or llama3, got {spec.rope_scaling!r}")
    config_cls = getattr(transformers, ARCHITECTURES[spec.arch].replace("ForCausalLM", "Config"))
    kwargs: dict[str, object] = {}
    if spec.arch == "mistral":
        kwargs["sliding_window"] = spec.sliding_window
    if spec.arch == "gemma3":
        config_cls = transformers.Gemma3TextConfig  # Gemma3Config is the multimodal model's
        # Global layers with rope_scaling's RoPE, sliding ones with their own base; every second
        # layer global (overrides may name layer_types or sliding_window_pattern instead).
        local = {"rope_type": "default", "rope_theta": 10_000.0}
        rope = {"full_attention": {**rope, "rope_theta": 1_000_000.0}, "sliding_attention": local}
        kwargs |= {"sliding_window": spec.sliding_window or 4096, "sliding_window_pattern": 2}
    kwargs.update(dict(spec.overrides))
    config = config_cls(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim or spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_parameters=rope,
        initializer_range=spec.init_std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=[ARCHITECTURES[spec.arch]],
        **kwargs,
    )
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec.dtype))
    with torch.no_grad():
        # Random norm weights (they are ones at init) so that a wrong norm shows in the logits;
        # Gemma's scale by (1 + w), so theirs are around zero (zeros at init).
        low = -0.5 if spec.arch == "gemma3" else 0.5
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(low, low + 1.0)
            elif name.endswith("bias"):
                p.normal_(0.0, spec.init_std)
    save_kwargs = {"max_shard_size": spec.max_shard_size} if spec.max_shard_size else {}
    model.save_pretrained(out, **save_kwargs)
    generation = {"max_new_tokens": spec.max_new_tokens} if spec.max_new_tokens else {}
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, do_sample=False, **generation
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
