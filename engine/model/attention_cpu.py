"""The attention backends of ppserve's CPU kernels (engine/model/cpu_kernels.py): RoPE fused with
the cache write, decode rows attended in place in the cache (no gather), and, where the library has
it for the model's head_dim, prefill chunks by the prefill kernel, which masks a sliding window
itself (so fresh prompts on windowed layers batch too). Without that kernel, prefill goes to SDPA."""

from __future__ import annotations

import torch

from ppserve.engine.model import cpu_kernels as kernel
from ppserve.engine.model.attention import AttentionMetadata
from ppserve.engine.model.attention_sdpa import SdpaAttention


class CpuDecodeAttention(SdpaAttention):
    """The CPU kernels for RoPE, the cache write and decode rows; SDPA for prefill chunks."""

    name = "cpu-decode+sdpa-prefill"

    def rope_and_write(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: torch.Tensor,
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kernel.rope_write_kv(q, k, v, cos, sin, md.slot_mapping, kv[0], kv[1])  # q, k rotated in place
        return q, k

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata, scale: float,
        window: int | None,
    ) -> torch.Tensor:  # fmt: skip
        d = md.decode
        assert d is not None
        with torch.profiler.record_function("ppserve::decode_attention"):  # named in profiles
            return kernel.decode_attention(q, k_cache, v_cache, d.block_tables, d.context_lens, scale, window)


class CpuAttention(CpuDecodeAttention):
    """The CPU kernels throughout."""

    name = "cpu"
    batches_windowed = True

    def prefill(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: int, scale: float,
        window: int | None, mask: torch.Tensor | None, out: torch.Tensor,
    ) -> None:  # fmt: skip
        with torch.profiler.record_function("ppserve::prefill_attention"):
            kernel.prefill_attention(q, keys, values, batch, scale, window, out=out)
