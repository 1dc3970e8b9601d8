"""The attention backend of torch's scaled_dot_product_attention, on any device: RoPE and the
cache write as torch ops, decode rows batched into one call over gathered keys (padded to the
longest context and masked), prefill chunks one call each (fresh prompts of one length together)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ppserve.engine.model.attention import AttentionMetadata, write_kv
from ppserve.engine.model.attention_backend import AttentionBackend
from ppserve.engine.model.rope import apply_rope


class SdpaAttention(AttentionBackend):
    name = "sdpa"

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
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        write_kv(kv[0], kv[1], k, v, md)
        return q, k

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata, scale: float,
        window: int | None,
    ) -> torch.Tensor:  # fmt: skip
        d = md.decode
        assert d is not None
        batch, kv_heads, head_dim = d.block_tables.shape[0], k_cache.shape[2], k_cache.shape[3]
        # keys: [batch, kv_heads, max_blocks * block_size, head_dim]; padding is masked out below.
        # (index_select on the flat table beats advanced indexing.)
        flat = d.block_tables.view(-1)
        keys = md.buffers.gather(0, k_cache, flat).view(batch, -1, kv_heads, head_dim).transpose(1, 2)
        values = md.buffers.gather(1, v_cache, flat).view(batch, -1, kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=d.mask(window), scale=scale, enable_gqa=True
        )
        return o.squeeze(2)

    def prefill(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: int, scale: float,
        window: int | None, mask: torch.Tensor | None, out: torch.Tensor,
    ) -> None:  # fmt: skip
        head_dim, kv_heads = q.shape[2], keys.shape[1]
        nq, nk = q.shape[0] // batch, keys.shape[0] // batch
        o = F.scaled_dot_product_attention(
            q.view(batch, nq, -1, head_dim).transpose(1, 2),
            keys.view(batch, nk, kv_heads, head_dim).transpose(1, 2),
            values.view(batch, nk, kv_heads, head_dim).transpose(1, 2),
            attn_mask=mask,
            is_causal=mask is None,  # a fresh prompt: plain causal, top-left aligned (nq == nk)
            scale=scale,
            enable_gqa=True,
        )
        out.copy_(o.transpose(1, 2).reshape(batch * nq, -1, head_dim))
