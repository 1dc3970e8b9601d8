"""The paged KV cache of one stage: its own layers only."""

from __future__ import annotations

import torch

from ppserve.engine.model.model_config import ModelConfig


def kv_bytes_per_block(cfg: ModelConfig, num_layers: int, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * element


def allocate_kv_cache(
    cfg: ModelConfig, num_layers: int, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[num_layers, 2 (k, v), num_blocks, block_size, kv_heads, head_dim].

    Zeroed, not empty: padded decode batches read (and mask out) slots of other blocks, and a
    masked NaN from uninitialised memory would still poison the weighted sum (0 * NaN = NaN).
    """
    shape = (num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)
