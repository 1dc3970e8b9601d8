"""Engine configuration: resolved once (no "auto" left inside), frozen, copied per stage."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.kv_cache import kv_bytes_per_block
from engine.model_config import ConfigError, ModelConfig
from engine.partition import partition_layers

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


@dataclass(frozen=True)
class EngineConfig:
    model: str
    model_config: ModelConfig
    pp_size: int
    layer_ranges: tuple[range, ...]  # per stage
    dtype: str  # a key of DTYPES
    device: str  # "cpu" or "cuda"
    block_size: int
    num_kv_blocks: int  # per stage; every stage holds the same block ids for its own layers
    max_model_len: int

    @classmethod
    def create(
        cls,
        model: str | Path,
        *,
        pp_size: int = 1,
        layer_partition: str | None = None,
        dtype: str = "auto",
        device: str = "cpu",
        block_size: int = 16,
        kv_cache_gb: float = 1.0,
        num_kv_blocks: int | None = None,
        max_model_len: int | None = None,
    ) -> EngineConfig:
        model_config = ModelConfig.from_dir(model)
        if device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' requested but no CUDA device is available")
        resolved_dtype = _resolve_dtype(dtype, model_config, device)
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        ranges = partition_layers(model_config.num_layers, pp_size, layer_partition)
        if max_model_len is None:
            max_model_len = model_config.max_position_embeddings
        elif not 1 <= max_model_len <= model_config.max_position_embeddings:
            raise ConfigError(
                f"max_model_len must be in [1, {model_config.max_position_embeddings}] "
                f"(the model's max_position_embeddings), got {max_model_len}"
            )
        if num_kv_blocks is None:
            if kv_cache_gb <= 0:
                raise ConfigError(f"kv_cache_gb must be > 0, got {kv_cache_gb}")
            # Sized by the stage with the most layers, so no stage uses more than kv_cache_gb.
            per_block = kv_bytes_per_block(
                model_config, max(len(r) for r in ranges), block_size, DTYPES[resolved_dtype]
            )
            num_kv_blocks = int(kv_cache_gb * 2**30) // per_block
        if num_kv_blocks < 1:
            raise ConfigError(f"the KV cache must hold at least one block, got {num_kv_blocks}")
        return cls(
            model=str(model),
            model_config=model_config,
            pp_size=pp_size,
            layer_ranges=ranges,
            dtype=resolved_dtype,
            device=device,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_model_len=max_model_len,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def _resolve_dtype(dtype: str, model_config: ModelConfig, device: str) -> str:
    if dtype == "auto":
        # The checkpoint's dtype on GPUs; float32 on CPU, where half-precision matmuls are slow.
        if device == "cpu":
            return "float32"
        dtype = model_config.dtype
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be auto, {', '.join(DTYPES)}; got {dtype!r}")
    return dtype
