"""Every configuration error is clear and names the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import LLAMA_CONFIG
from safetensors.torch import load_file, save_file

from ppserve.engine.config import EngineConfig
from ppserve.engine.model.model_config import ConfigError, ModelConfig
from ppserve.engine.model.partition import partition_layers
from ppserve.engine.offline import OfflineEngine


@pytest.mark.parametrize(
    ("spec", "pp", "message"),
    [
        ("3,3", 2, "sums to 6 but the model has 10 layers"),
        ("5,0,5", 3, "every stage needs at least one layer"),
        ("-1,11", 2, "every stage needs at least one layer"),
        ("3,3,4", 2, "has 3 stages but pp_size is 2"),
        ("3;3;4", 3, "malformed layer partition '3;3;4'"),
        ("3,,7", 3, "malformed layer partition"),
        ("a,b", 2, "malformed layer partition"),
        (None, 11, "pp_size 11 is larger than the model's 10 layers"),
        (None, 0, "pp_size must be >= 1"),
    ],
)
def test_partition_errors(spec: str | None, pp: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        partition_layers(10, pp, spec)


def test_partition_even_split_puts_remainder_last() -> None:
    assert [len(r) for r in partition_layers(10, 3)] == [3, 3, 4]
    assert [len(r) for r in partition_layers(11, 4)] == [2, 3, 3, 3]
    assert partition_layers(10, 3, "2, 5,3") == (range(0, 2), range(2, 7), range(7, 10))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
        ({"architectures": []}, "unsupported architecture '\\(none\\)'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4}}, "rope type 'yarn'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "llama3 rope scaling needs"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 0}}, "rope factor must be positive"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
        ({"hidden_size": 0}, "hidden_size must be a positive integer"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantized checkpoints"),
        (
            {"architectures": ["Qwen2ForCausalLM"], "layer_types": ["full_attention", "chunked_attention"]},
            "layer type 'chunked_attention'",
        ),
        (
            {"architectures": ["Qwen3ForCausalLM"], "layer_types": ["full_attention"]},
            "layer_types has 1 entries for 2 layers",
        ),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 0}, "sliding_window must be a positive"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_scaling": {"type": "linear"}},
            "both rope_parameters and rope_scaling",
        ),
    ],
)
def test_model_config_errors(change: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**LLAMA_CONFIG, **change})


def test_defaults_follow_transformers() -> None:
    """Keys a config may omit take transformers' defaults, not ours."""
    mistral = ModelConfig.from_dict({**LLAMA_CONFIG, "architectures": ["MistralForCausalLM"]})
    assert mistral.sliding_windows == (4096, 4096)
    qwen3 = ModelConfig.from_dict({**LLAMA_CONFIG, "architectures": ["Qwen3ForCausalLM"]})
    assert qwen3.head_dim == 128
    qwen2 = ModelConfig.from_dict(
        {**LLAMA_CONFIG, "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 30, "use_sliding_window": True}
    )
    assert qwen2.sliding_windows == (None,) * 28 + (4096, 4096)
    assert ModelConfig.from_dict({**LLAMA_CONFIG, "hidden_act": "swish"}).architecture == "LlamaForCausalLM"


def test_old_style_rope_and_qwen_sliding_layers() -> None:
    cfg = ModelConfig.from_dict({**LLAMA_CONFIG, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0}})
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.rope.factor) == (5e5, "linear", 4.0)
    qwen = ModelConfig.from_dict(
        {
            **LLAMA_CONFIG,
            "architectures": ["Qwen2ForCausalLM"],
            "use_sliding_window": True,
            "sliding_window": 64,
            "max_window_layers": 1,
        }
    )
    assert qwen.sliding_windows == (None, 64)
    assert qwen.qkv_bias and not qwen.o_proj_bias


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_files(tmp_path: Path, llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"no config\.json in"):
        EngineConfig.create(tmp_path)
    broken = _copy(llama_dir, tmp_path / "nofile")
    (broken / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        OfflineEngine(EngineConfig.create(broken, num_kv_blocks=8))
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json is not valid JSON"):
        EngineConfig.create(broken)


def test_broken_shard_index(tmp_path: Path, sharded_dir: Path) -> None:
    ckpt = _copy(sharded_dir, tmp_path / "s")
    shard = sorted(ckpt.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ConfigError, match=f"shard {shard.name} listed in model.safetensors.index.json is missing"):
        OfflineEngine(EngineConfig.create(ckpt, num_kv_blocks=8))
    (ckpt / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ConfigError, match="is not a valid index"):
        OfflineEngine(EngineConfig.create(ckpt, num_kv_blocks=8))


def test_missing_and_misshaped_tensors(tmp_path: Path, llama_dir: Path) -> None:
    ckpt = _copy(llama_dir, tmp_path / "m")
    tensors = load_file(ckpt / "model.safetensors")
    missing = dict(tensors)
    del missing["model.layers.3.mlp.up_proj.weight"]
    save_file(missing, ckpt / "model.safetensors")
    # Stage 0 of 2 owns layers 0-1 and does not need the missing tensor; stage 1 does.
    with pytest.raises(ConfigError, match=r"missing tensor\(s\): model.layers.3.mlp.up_proj.weight"):
        OfflineEngine(EngineConfig.create(ckpt, pp_size=2, num_kv_blocks=8))
    wrong = dict(tensors)
    wrong["model.layers.0.self_attn.k_proj.weight"] = wrong["model.layers.0.self_attn.k_proj.weight"][:8]
    save_file(wrong, ckpt / "model.safetensors")
    with pytest.raises(ConfigError, match=r"tensor model.layers.0.self_attn.k_proj.weight has shape \(8, 64\)"):
        OfflineEngine(EngineConfig.create(ckpt, num_kv_blocks=8))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "int8"}, "dtype must be auto, float32, bfloat16, float16; got 'int8'"),
        ({"device": "tpu"}, "device \\(--device\\) must be one of cpu, cuda; got 'tpu'"),
        ({"block_size": 0}, "block_size \\(--block-size\\) must be >= 1"),
        ({"max_model_len": 10**7}, "max_model_len must be in"),
        ({"kv_cache_gb": 0.0}, "kv_cache_gb \\(--kv-cache-gb\\) must be > 0"),
        ({"kv_cache_gb": float("inf")}, "kv_cache_gb \\(--kv-cache-gb\\) must be a finite number"),
        ({"kv_cache_gb": float("nan")}, "kv_cache_gb \\(--kv-cache-gb\\) must be a finite number"),
        ({"num_kv_blocks": 0}, "num_kv_blocks must be >= 1"),
        ({"pp_size": 2, "layer_partition": "1,2"}, "sums to 3 but the model has 4 layers"),
    ],
)
def test_engine_config_errors(llama_dir: Path, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig.create(llama_dir, **kwargs)  # type: ignore[arg-type]


def test_cuda_requested_without_gpu(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA device is available"):
        EngineConfig.create(llama_dir, device="cuda")


def test_dtype_resolution(llama_dir: Path, tmp_path: Path) -> None:
    assert EngineConfig.create(llama_dir).dtype == "float32"  # auto on CPU
    assert EngineConfig.create(llama_dir, dtype="bf16").dtype == "bfloat16"
    ckpt = _copy(llama_dir, tmp_path / "bf")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.from_dir(ckpt).dtype == "bfloat16"


def test_prompt_too_long(llama_dir: Path) -> None:
    from ppserve.scheduler.sampling_params import SamplingParams

    pipe = OfflineEngine(EngineConfig.create(llama_dir, num_kv_blocks=8, max_model_len=20))
    with pytest.raises(ValueError, match="prompt has 20 tokens; the model's context length is 20"):
        pipe.generate([[5] * 20], SamplingParams())
    with pytest.raises(ValueError, match="prompt must contain at least one token"):
        pipe.generate([[]], SamplingParams())
