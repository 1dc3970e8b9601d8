"""Gemma 3 (Gemma3ForCausalLM) against transformers, on tiny random checkpoints whose sliding window
(16) is shorter than the prompts (40 tokens), with global and sliding layers interleaved: logits and
greedy tokens at PP=1, 2 and 3, chunked prefill across the window's edge, a prefix from the cache;
its config.json's checks; and a GGUF written as llama.cpp's converter writes Gemma 3."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf_files import _add_tokenizer
from helpers import pipeline, prompt_logits, random_prompt
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from ppserve.engine.config import EngineConfig
from ppserve.engine.model.model import GemmaDecoderLayer
from ppserve.engine.model.model_config import ConfigError, ModelConfig, RopeConfig
from ppserve.engine.model.tiny_checkpoint import TinySpec, make_tiny_checkpoint
from ppserve.engine.offline import OfflineEngine
from ppserve.scheduler.sampling_params import SamplingParams
from ppserve.transport.messages import Sampled, SeqChunk

WINDOW, PROMPT, NEW = 16, 40, 12
SPECS = {
    # Layers s s G s s G: at PP=3 the first stage has sliding layers only. query_pre_attn_scalar is
    # neither head_dim nor transformers' default.
    "gemma3": TinySpec(
        arch="gemma3",
        seed=31,
        num_layers=6,
        sliding_window=WINDOW,
        overrides=(("sliding_window_pattern", 3), ("query_pre_attn_scalar", 20)),
    ),
    # Tied embeddings (as the published models), biases, linear scaling of the global RoPE, a
    # head_dim that is not hidden / heads, one KV head.
    "gemma3-variant": TinySpec(
        arch="gemma3",
        seed=32,
        sliding_window=WINDOW,
        head_dim=24,
        num_kv_heads=1,
        rope_scaling="linear",
        tie_word_embeddings=True,
        overrides=(("attention_bias", True),),
    ),
}
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma3")
    return {name: make_tiny_checkpoint(root / name, spec) for name, spec in SPECS.items()}


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPSERVE_CACHE_DIR", str(tmp_path / "cache"))


def hf_model(model_dir: Path, dtype: torch.dtype = torch.float32, **kwargs: Any) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs).eval()


_REFERENCES: dict[tuple[str, tuple[int, ...]], tuple[list[int], list[float]]] = {}


def hf_reference(hf: torch.nn.Module, prompt: list[int], n: int = NEW) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens (the whole sequence recomputed each step, no cache) and their
    float32 logprobs; once per checkpoint and prompt (float32 models only)."""
    key = (str(hf.name_or_path), tuple(prompt))
    if key not in _REFERENCES:
        _REFERENCES[key] = _greedy(hf, prompt, n)
    return _REFERENCES[key]


def _greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(torch.log_softmax(logits, dim=-1)[token].item())
            ids.append(token)
    return ids[len(prompt) :], logprobs


def hf_logits(hf: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float()


def assert_close(got: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4) -> None:
    scale = max(1.0, expected.abs().max().item())
    assert (got - expected).abs().max().item() <= tol * scale


def logprobs_of(samples: list[Sampled]) -> list[float]:
    got = [s.logprob for s in samples]
    assert all(g is not None for g in got)
    return [float(g or 0.0) for g in got]


def assert_generates(pipe: OfflineEngine, prompts: list[list[int]], hf: torch.nn.Module) -> None:
    """Each prompt's greedy tokens are transformers', and so (to rounding) are their logprobs."""
    for prompt, out in zip(prompts, pipe.generate(prompts, GREEDY), strict=True):
        tokens, logprobs = hf_reference(hf, prompt)
        assert out.token_ids == tokens
        assert np.allclose(logprobs_of(out.samples), logprobs, atol=1e-4)


@pytest.mark.parametrize("name", list(SPECS))
def test_matches_transformers_split_or_not(ckpts: dict[str, Path], name: str) -> None:
    hf = hf_model(ckpts[name])
    prompt = random_prompt(random.Random(name), PROMPT)
    expected = hf_logits(hf, prompt)
    for pp in (1, 2, 3):
        pipe = pipeline(ckpts[name], pp_size=pp)
        assert_close(prompt_logits(pipe, prompt), expected)
        assert_generates(pipe, [prompt], hf)
        for runner in pipe.executor.runners:
            assert runner.model.decode_step is not None  # Gemma's layers in one call too (test_decode_step.py)
            for layer in runner.model.model.layers.values():
                assert isinstance(layer, GemmaDecoderLayer)
                assert not getattr(layer.mlp.gate_up, "silu", False)  # no SiLU in the GEMM: Gemma's is GELU


def test_bfloat16_is_close_to_transformers(ckpts: dict[str, Path]) -> None:
    hf = hf_model(ckpts["gemma3"], torch.bfloat16)
    prompt = random_prompt(random.Random(5), PROMPT)
    expected = hf_logits(hf, prompt)
    assert_close(prompt_logits(pipeline(ckpts["gemma3"], pp_size=2, dtype="bfloat16"), prompt), expected, 2e-2)


@pytest.mark.parametrize("pp", [1, 3])
def test_chunked_prefill_across_the_window(ckpts: dict[str, Path], pp: int) -> None:
    """A prompt prefilled in uneven chunks, some of them across the window's edge and the KV
    blocks' (4 positions each), gives transformers' logits at every position; served with 8-token
    chunks, the same tokens."""
    model_dir = ckpts["gemma3"]
    hf = hf_model(model_dir)
    prompt = random_prompt(random.Random(pp), PROMPT)
    expected = hf_logits(hf, prompt)
    pipe = pipeline(model_dir, pp_size=pp, block_size=4, chunked_prefill_size=8)
    blocks = pipe.allocator.allocate(pipe.allocator.blocks_for(PROMPT))
    rows, start = [], 0
    for n in (5, 7, 1, 9, 3, 13, 2):  # positions 0-39; chunks end at 5, 12, 13, 22, ...
        chunk = SeqChunk("p", prompt[start : start + n], start, blocks, True)
        rows.append(pipe.executor.forward([chunk], all_logits=True))
        start += n
    pipe.allocator.free(blocks)
    assert start == PROMPT
    assert_close(torch.cat(rows), expected)
    assert_generates(pipe, [prompt, prompt[:23]], hf)


def test_prefix_from_the_cache(ckpts: dict[str, Path]) -> None:
    """A second request sharing a prefix longer than the window starts from the cached blocks,
    and its tokens are still transformers'."""
    model_dir = ckpts["gemma3-variant"]
    hf = hf_model(model_dir)
    rng = random.Random(9)
    prefix = random_prompt(rng, 32)
    first, second = prefix + random_prompt(rng, 8), prefix + random_prompt(rng, 5)
    pipe = pipeline(model_dir, pp_size=2, block_size=4, chunked_prefill_size=8, enable_prefix_caching=True)
    assert_generates(pipe, [first], hf)
    request = pipe.request(second, GREEDY)
    samples = pipe.run([request])[request.request_id]
    assert request.num_cached_tokens and request.num_cached_tokens >= 32
    tokens, logprobs = hf_reference(hf, second)
    assert request.output_token_ids == tokens
    assert np.allclose(logprobs_of(samples), logprobs, atol=1e-4)


def _config(**changes: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
    }
    raw.update(changes)
    return {k: v for k, v in raw.items() if v is not None}


def test_legacy_config_resolves_as_transformers_does() -> None:
    """A config.json as transformers 4 wrote Gemma 3's (rope_theta, rope_scaling, rope_local_base_freq,
    sliding_window_pattern) and one with nothing but sizes: the RoPE per layer kind, the layer kinds
    and the defaults that Gemma3TextConfig resolves them to."""
    legacy = _config(
        rope_theta=500_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        rope_local_base_freq=20_000.0,
        sliding_window=32,
        sliding_window_pattern=4,
        query_pre_attn_scalar=24,
    )
    for raw in (legacy, _config()):
        ours = ModelConfig.from_dict(raw)
        theirs = Gemma3TextConfig(**{k: v for k, v in raw.items() if k != "architectures"})
        assert theirs.rope_parameters is not None and theirs.layer_types is not None
        full, local = theirs.rope_parameters["full_attention"], theirs.rope_parameters["sliding_attention"]
        assert ours.rope_local is not None
        assert (ours.rope.theta, ours.rope.rope_type, ours.rope.factor) == (
            full["rope_theta"],
            full["rope_type"],
            full.get("factor", 1.0),
        )
        assert (ours.rope_local.theta, ours.rope_local.rope_type) == (local["rope_theta"], local["rope_type"])
        windows = tuple(theirs.sliding_window if t == "sliding_attention" else None for t in theirs.layer_types)
        assert ours.sliding_windows == windows and None in windows
        assert (ours.head_dim, ours.query_pre_attn_scalar, ours.tie_word_embeddings) == (
            theirs.head_dim,
            theirs.query_pre_attn_scalar,
            theirs.tie_word_embeddings,
        )
        assert ours.hidden_act == theirs.hidden_activation and ours.qk_norm and ours.gemma_norms


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is not supported"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope type 'yarn' is not supported"),
        ({"rope_parameters": {"rope_type": "default"}}, "must be keyed by layer type"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types has 3 entries for 8 layers"),
        ({"layer_types": ["chunked_attention"] * 8}, "layer type 'chunked_attention'"),
    ],
)
def test_what_is_not_implemented_is_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(_config(**changes))


# --- GGUF --------------------------------------------------------------------------------------

# As the published models are: every 6th layer global, query_pre_attn_scalar = head_dim = 256 (what
# transformers' GGUF loader assumes; llama.cpp takes head_dim), the local RoPE base 10000, tied
# embeddings: what a Gemma 3 GGUF does not say.
GGUF_SPEC = TinySpec(
    arch="gemma3", seed=33, num_layers=7, sliding_window=WINDOW, tie_word_embeddings=True, head_dim=256,
    overrides=(("sliding_window_pattern", 6),),
)  # fmt: skip


def write_gemma3_gguf(model_dir: Path, out: Path) -> Path:
    """The checkpoint as llama.cpp's converter writes Gemma 3 (convert_hf_to_gguf.py, Gemma3Model):
    gguf-py's names for the arch, F32 tensors, every norm weight plus one."""
    config = json.loads((model_dir / "config.json").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, config["num_hidden_layers"])
    writer = gguf.GGUFWriter(out, "gemma3")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["full_attention"]["rope_theta"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    _add_tokenizer(writer, model_dir)
    for name, values in sorted(load_file(str(model_dir / "model.safetensors")).items()):
        base, _, kind = name.rpartition(".")
        values = values.astype(np.float32) + (1.0 if name.endswith("norm.weight") else 0.0)
        writer.add_tensor(f"{names.get_name(base)}.{kind}", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gemma3-gguf")
    hf_dir = make_tiny_checkpoint(root / "hf", GGUF_SPEC)
    return hf_dir, write_gemma3_gguf(hf_dir, root / "gemma3-tiny.gguf")


def test_gguf_gives_the_checkpoints_logits(gguf_pair: tuple[Path, Path]) -> None:
    """Through GGUF (names, the norms' +1, the window and layer kinds llama.cpp assumes, the tied
    head) the engine computes bit for bit what it computes from safetensors, which is
    transformers' own reading of the GGUF (to rounding)."""
    hf_dir, path = gguf_pair
    prompt = random_prompt(random.Random(3), PROMPT)
    expected = prompt_logits(pipeline(hf_dir, pp_size=2), prompt)
    from_gguf = pipeline(path, pp_size=2)
    assert torch.equal(prompt_logits(from_gguf, prompt), expected)
    ours, reference = from_gguf.config.model_config, EngineConfig.create(hf_dir).model_config
    fields = ("rope", "rope_local", "sliding_windows", "query_pre_attn_scalar", "head_dim", "num_kv_heads")
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(reference, f) for f in fields}
    hf = hf_model(path.parent, gguf_file=path.name)
    assert_close(prompt_logits(from_gguf, prompt), hf_logits(hf, prompt))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("gemma3.attention.sliding_window", None, "'gemma3.attention.sliding_window' is missing"),
        ("gemma3.final_logit_softcapping", 30.0, "'gemma3.final_logit_softcapping' is not supported"),
    ],
)
def test_gguf_without_what_gemma3_needs_is_refused(
    gguf_pair: tuple[Path, Path], tmp_path: Path, key: str, value: float | None, message: str
) -> None:
    hf_dir, _ = gguf_pair
    good, path = write_gemma3_gguf(hf_dir, tmp_path / "good.gguf"), tmp_path / "bad.gguf"
    assert (key in gguf.GGUFReader(good).fields) == (value is None)  # what is dropped was there
    _rewrite(good, path, key, value)
    with pytest.raises(ConfigError, match=message):
        EngineConfig.create(path)


def _rewrite(src: Path, out: Path, key: str, value: float | None) -> None:
    """`src` again, with metadata `key` dropped (value None) or set to a float32 `value`."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(out, "gemma3")
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture")) or field.name == key:
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(field.name, field.contents())
        else:
            writer.add_key_value(field.name, field.contents(), kind)
    if value is not None:
        writer.add_float32(key, value)
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape.tolist())]
        writer.add_tensor(t.name, np.asarray(t.data).reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_rope_scaling_is_the_global_layers_only(ckpts: dict[str, Path]) -> None:
    mc = EngineConfig.create(ckpts["gemma3-variant"]).model_config
    assert (mc.rope.rope_type, mc.rope.factor, mc.rope.theta) == ("linear", 2.0, 1_000_000.0)
    assert mc.rope_local == RopeConfig(theta=10_000.0)
